"""What a campaign fuzzes: the Case and how it is drawn.

- `case`: the Case (config, workload, schedule, faults) and its versioned JSON form, the unit
  every reproducer stores;
- `strategies`: the Hypothesis strategies that draw Cases, every toggle shrinking open;
- `limits`: the config limits a Case can reach (read from the Case) and the draws that aim at
  each one exactly and one off.
"""
