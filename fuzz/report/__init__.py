"""Reports of a campaign or selftest summary: HTML with plots and a markdown job summary
(`render`; `svg` draws the plots). `python -m fuzz.report SUMMARY.json --html out.html`."""
