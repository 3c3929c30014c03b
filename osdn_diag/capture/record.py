"""One captured kernel call, in the canonical form the replay engine reads.

An adapter (:mod:`osdn_diag.capture.adapters`) turns the arguments an fla kernel received into this
form by reproducing what the kernel does inside (l2-norm, β sigmoid, gate activation, d of a
preconditioned layer), so that replay sees exactly the recurrence the kernel ran:

* ``q, k: [B, T, H, K]`` — queries and keys as the state update reads them (after any in-kernel
  l2-norm; ``q`` *not* yet multiplied by ``scale``);
* ``v: [B, T, H, V]``, ``beta: [B, T, H]`` (after any in-kernel sigmoid);
* ``g`` — log decay, ``[B, T, H]`` (head gate) or ``[B, T, H, K]`` (key-channel gate), or ``None``;
* ``d: [B, T, H, K]`` — the write-key preconditioner (``k̃ = d ⊙ k``), or ``None`` (``d ≡ 1``);
* ``write_key: [B, T, H, K]`` — the write key exactly as the kernel read it, where that is not the
  fp32 product ``d ⊙ k`` (fla's preconditioned chunk paths and the OSDN layers' phase 2 store it in
  the input dtype), else ``None``; replay writes with it when present;
* ``initial_state: [N, H, V, K]`` (always the ``V×K`` convention; KDA's is transposed on capture);
* ``o: [B, T, H, V]`` — what the kernel returned, for the fidelity check;
* ``final_state: [N, H, V, K]`` — the kernel's own fp32 final state (capture asks every kernel for
  it), for the state fidelity check, or ``None``;
* ``cu_seqlens: [N + 1]`` for packed sequences (``B == 1``), or ``None`` (then ``N == B``);
* ``extra`` — a family's further inputs by name (``[B, T, H, ·]`` or ``[B, T, H]``, e.g. a removal key
  that differs from the write key), stored as ``extra.NAME`` in the shard; empty for the delta-rule
  families. Whatever reads them is the family's replay (:mod:`osdn_diag.replay.families`). Extras
  named ``initial_*`` / ``final_*`` are per-sequence states (``[N, H, ·, ·]``, e.g. a momentum buffer),
  not per-token inputs.

Tensors are stored in fp32 (the kernel's own dtype is kept in ``input_dtype``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["EXTRA_PREFIX", "KernelCall", "TENSOR_FIELDS"]

#: The shard key prefix of :attr:`KernelCall.extra` tensors.
EXTRA_PREFIX = "extra."
TENSOR_FIELDS = ("q", "k", "v", "beta", "g", "d", "write_key", "initial_state", "o", "final_state", "cu_seqlens")


@dataclass
class KernelCall:
    """One call of a delta-rule kernel by one layer; see the module docstring for the fields."""

    layer: int
    layer_name: str
    family: str
    kernel: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    beta: torch.Tensor
    o: torch.Tensor
    scale: float
    g: torch.Tensor | None = None
    d: torch.Tensor | None = None
    write_key: torch.Tensor | None = None
    initial_state: torch.Tensor | None = None
    final_state: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    input_dtype: str = "float32"
    flags: dict = field(default_factory=dict)
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    forward: int = 0  # which forward pass of the capture session made the call

    @property
    def num_heads(self) -> int:
        return self.k.shape[2]

    @property
    def head_k_dim(self) -> int:
        return self.k.shape[3]

    @property
    def head_v_dim(self) -> int:
        return self.v.shape[3]

    @property
    def gated(self) -> bool:
        return self.g is not None

    def segments(self) -> list[tuple[int, int, int]]:
        """``(row, start, end)`` of every sequence: one per batch row, or one per packed segment."""
        B, T = self.k.shape[:2]
        if self.cu_seqlens is None:
            return [(b, 0, T) for b in range(B)]
        offs = [int(x) for x in self.cu_seqlens.tolist()]
        return [(0, s, e) for s, e in zip(offs[:-1], offs[1:])]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The non-empty tensor fields, contiguous and on the CPU (for safetensors)."""
        out = {}
        for name in TENSOR_FIELDS:
            x = getattr(self, name)
            if x is not None:
                out[name] = x.detach().to("cpu").contiguous()
        for name, x in self.extra.items():
            out[EXTRA_PREFIX + name] = x.detach().to("cpu").contiguous()
        return out

    def metadata(self) -> dict:
        return {
            "layer": self.layer,
            "layer_name": self.layer_name,
            "family": self.family,
            "kernel": self.kernel,
            "scale": self.scale,
            "input_dtype": self.input_dtype,
            "flags": dict(self.flags),
            "forward": self.forward,
        }

    @classmethod
    def from_parts(cls, meta: dict, tensors: dict[str, torch.Tensor]) -> KernelCall:
        return cls(
            layer=int(meta["layer"]),
            layer_name=str(meta["layer_name"]),
            family=str(meta["family"]),
            kernel=str(meta["kernel"]),
            scale=float(meta["scale"]),
            input_dtype=str(meta.get("input_dtype", "float32")),
            flags=dict(meta.get("flags", {})),
            forward=int(meta.get("forward", 0)),
            extra={n.removeprefix(EXTRA_PREFIX): x for n, x in tensors.items() if n.startswith(EXTRA_PREFIX)},
            **{name: tensors.get(name) for name in TENSOR_FIELDS},
        )
