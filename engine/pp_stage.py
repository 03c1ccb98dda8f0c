"""PPStage: one rank's pipeline-parallel edges (vLLM v1 names).

Receive: the previous stage's IntermediateTensors are copied into persistent buffers
(`sync_and_slice_intermediate_tensors`; graphs capture their addresses). Send: hidden states
and residual to the next stage, the all_gather split applied only to what is replicated
across TP ranks. With broadcast_pp_output every rank samples from the last stage's logits.
And the stage's layer range, re-derived per Case.
"""
from __future__ import annotations

import torch

from engine.async_copy import AsyncCopier, CopyHandle
from engine.config import EngineConfig
from engine.faults import (INTERMEDIATE_COPY_UNSYNCED, PP_ALLGATHER_NON_REPLICATED, PP_LOGITS_NOT_BROADCAST,
                           PP_UNEVEN_PARTITION, SP_RESIDUAL_COPY_LEN, FaultSet)
from engine.model import IntermediateTensors, LlamaForCausalLM
from engine.parallel_state import RankGroups
from engine.poison import fill_floats


class PPStage:
    """The PP edges of one rank: its receive buffers, send, logits broadcast, layer range."""

    def __init__(self, cfg: EngineConfig, groups: RankGroups, faults: FaultSet, copier: AsyncCopier,
                 max_num_tokens: int, is_last: bool) -> None:
        self.cfg, self.g, self.faults, self.copier, self.is_last = cfg, groups, faults, copier, is_last
        # Persistent PP receive buffers (sync_and_slice_intermediate_tensors copies into them).
        self.intermediate_tensors = {
            k: torch.zeros(max_num_tokens, cfg.hidden_size, dtype=cfg.torch_dtype(), device=cfg.device)
            for k in ("hidden_states", "residual")}
        self._stale_logits: torch.Tensor | None = None

    def reset(self, poison: str) -> None:
        for k, t in self.intermediate_tensors.items():
            fill_floats(t, poison, k)
        self._stale_logits = None

    def layer_end(self, m: LlamaForCausalLM) -> int:
        """Where this stage's layer loop stops: the end of its partition, however unevenly
        the layers split (docs/bug_classes.md#pp_uneven_partition)."""
        uneven = self.cfg.num_hidden_layers % self.cfg.pp != 0
        if self.faults.on(PP_UNEVEN_PARTITION) and uneven and m.is_last:
            return m.end - 1
        return m.end

    # -- receive ---------------------------------------------------------------------------------
    def recv(self, num_tokens: int) -> IntermediateTensors:
        recv = self.g.pp.recv_tensor_dict(all_gather_group=self.g.tp)
        return self.sync_and_slice_intermediate_tensors(recv, num_tokens)

    def sync_and_slice_intermediate_tensors(self, recv: dict, num_tokens: int) -> IntermediateTensors:
        """Copy the received tensors into the persistent PP buffers and return their slices."""
        out = {}
        for k, v in recv.items():
            copy_len = self._copy_len(k, num_tokens)
            h = self.copier.copy(self.intermediate_tensors[k][:copy_len], v[:copy_len])
            self._wait_for_copy(h)
            out[k] = self.intermediate_tensors[k][:self._rows(k, num_tokens)]
        return IntermediateTensors(out["hidden_states"], out["residual"])

    def _rows(self, key: str, num_tokens: int) -> int:
        """Rows of `key` on this rank: the sequence-parallel residual is scattered over TP."""
        return num_tokens // self.cfg.tp if (key == "residual" and self.cfg.sequence_parallel) else num_tokens

    def _copy_len(self, key: str, num_tokens: int) -> int:
        """Copy every row this rank holds of `key` (docs/bug_classes.md#sp_residual_copy_len)."""
        if self.faults.on(SP_RESIDUAL_COPY_LEN):
            # The bug: `is_scattered = "residual" and sp` is just sp, for every key.
            return num_tokens // self.cfg.tp if self.cfg.sequence_parallel else num_tokens
        return self._rows(key, num_tokens)

    def _wait_for_copy(self, h: CopyHandle) -> None:
        """The copy is non_blocking and the stage reads the buffer next: wait for it
        (docs/bug_classes.md#intermediate_copy_unsynced)."""
        if self.faults.on(INTERMEDIATE_COPY_UNSYNCED):
            return
        self.copier.wait(h)

    # -- send ------------------------------------------------------------------------------------
    def send(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> None:
        self.g.pp.send_tensor_dict({"hidden_states": hidden_states, "residual": residual},
                                   all_gather_group=self.g.tp, scattered=self._scattered_keys())

    def _scattered_keys(self) -> tuple[str, ...]:
        """The sequence-parallel residual differs per TP rank: it must go whole (applying the
        all_gather split to it is docs/bug_classes.md#pp_allgather_non_replicated)."""
        if self.faults.on(PP_ALLGATHER_NON_REPLICATED):
            return ()
        return ("residual",) if self.cfg.sequence_parallel else ()

    # -- logits ----------------------------------------------------------------------------------
    def broadcast_logits(self, logits: torch.Tensor | None) -> torch.Tensor:
        """Every rank receives the last stage's logits and samples itself
        (docs/bug_classes.md#pp_logits_not_broadcast)."""
        logits = self.g.pp.broadcast_tensor_dict({"logits": logits} if self.is_last else None,
                                                 src=self.cfg.pp - 1)["logits"]
        return logits if self.is_last else self._logits_to_sample(logits)

    def broadcast_sampled(self, ids: torch.Tensor | None) -> torch.Tensor:
        """Every stage receives the last stage's sampled token ids (async scheduling)."""
        return self.g.pp.broadcast_tensor_dict({"ids": ids} if self.is_last else None, src=self.cfg.pp - 1)["ids"]

    def _logits_to_sample(self, broadcast: torch.Tensor) -> torch.Tensor:
        """A non-last rank samples from the logits it just received."""
        if self.faults.on(PP_LOGITS_NOT_BROADCAST):
            # The bug: sample from the previous step's logits, not the broadcast.
            stale, self._stale_logits = self._stale_logits, broadcast
            return stale if stale is not None and stale.shape == broadcast.shape else torch.zeros_like(broadcast)
        return broadcast
