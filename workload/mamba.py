"""A Mamba-2 mixer (transformers' NemotronHMamba2Mixer and Mamba2Mixer: in_proj, a depthwise causal conv1d, the
SSD scan, a grouped RMSNorm gated by silu(z), out_proj) counted on the meta device as Megatron-core trains one.

Off the meta device a mixer computes what transformers computes (`run` trains it, `calibrate` times it: on a CPU
its PyTorch reference). On the meta device that reference is not what a GPU runs: it computes in float32, copies
B and C to every head and materialises each chunk's Q x Q decay masks. Megatron-core's MambaMixer runs it as
mamba_ssm's kernels instead (Megatron-LM d98e8a64 megatron/core/ssm/mamba_mixer.py `_ssm_training`, its default
`use_mamba_mem_eff_path`): in_proj; `mamba_split_conv1d_scan_combined` without the norm and out_proj weights,
which runs causal_conv1d's kernel and the five Triton kernels of the chunked scan (state-spaces/mamba e9594ce1
mamba_ssm/ops/triton/ssd_combined.py `_mamba_chunk_scan_combined_fwd`), the gate silu(z) fused into the last; the
grouped RMSNorm (layernorm_gated.py `RMSNorm` with z None, `norm_before_gate` False); out_proj. The count records
each kernel as one op, with the tensors it reads and writes and the FLOPs of its products (`_kernel`). It saves
what those functions save: the in_proj output zxbcdt and the scan's output before the gate
(`MambaSplitConv1dScanCombinedFn`'s `save_for_backward`), the norm's input and its float32 statistics, out_proj's
input. Its backward recomputes the conv output, the chunk states and C·Bᵀ before the scan's backward kernels
(`_mamba_chunk_scan_combined_bwd`), each recorded as it runs.

With T tokens, H heads of P channels (d = H·P), G groups of state size N, chunks of Q tokens and a conv of K taps
over C = d + 2·G·N channels, the scan's products are 2·T·(2·d·N + Q·G·N + Q·d) FLOPs forward and 2·T·(5·d·N +
3·Q·d + 3·Q·G·N) backward, its recomputation included: NVIDIA's dgxc-benchmarking Nemotron-H formula
(nemotronh/README.md) counts the forward so. A chunk's intra-chunk products are counted whole, the causal mask's
upper tiles included: the autotuned tile of 64 or 128 rows computes 3/4 to all of them. Megatron-LM's own
`mamba_layer_flops` (training.py) takes d as twice the model's width whatever the config's heads, 27 % over at
Nemotron 3 Nano's mixer; pipesim counts the config's."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from .moe import _kernel_writes, _one_kernel

MIXER_FIELDS = ("in_proj", "conv1d", "A_log", "D", "dt_bias", "norm", "out_proj", "num_heads", "head_dim", "n_groups",
                "ssm_state_size", "chunk_size")


def is_mamba2_mixer(module: nn.Module) -> bool:
    """Whether `module` is a Mamba-2 mixer laid out as transformers' (Mamba2Mixer, NemotronHMamba2Mixer, ...)."""
    return all(hasattr(module, name) for name in MIXER_FIELDS)


def counted_mixer(mixer: nn.Module, computed: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
    """`mixer`'s forward, handed its hidden states first or by name (GraniteMoeHybrid's `hidden_states=`): on the
    meta device as Megatron-core's kernels run it (the module docstring), elsewhere `computed`, transformers' own."""
    hidden = args[0] if args else kwargs["hidden_states"]
    if hidden.device.type != "meta":
        return computed(*args, **kwargs)
    zxbcdt = mixer.in_proj(hidden)
    A = -torch.exp(mixer.A_log.float())
    gated = _Scan.apply(_Shape.of(mixer, zxbcdt), zxbcdt, mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias,
                        mixer.dt_bias, A, mixer.D)
    return mixer.out_proj(_GroupNorm.apply(gated, mixer.norm.weight, mixer.n_groups))


@dataclass(frozen=True)
class _Shape:
    """A mixer's sizes at a micro-batch: b sequences of s tokens (T = b·s), H heads of P (d = H·P), G groups of
    state size N, chunks of Q (nc a sequence), a conv of K taps over C = d + 2·G·N channels."""

    b: int
    s: int
    H: int
    P: int
    G: int
    N: int
    Q: int
    K: int

    @property
    def d(self) -> int:
        return self.H * self.P

    @property
    def T(self) -> int:
        return self.b * self.s

    @property
    def nc(self) -> int:
        return math.ceil(self.s / self.Q)

    @property
    def C(self) -> int:
        return self.d + 2 * self.G * self.N

    @classmethod
    def of(cls, mixer: nn.Module, zxbcdt: torch.Tensor) -> _Shape:
        b, s, _ = zxbcdt.shape
        return cls(b, s, mixer.num_heads, mixer.head_dim, mixer.n_groups, mixer.ssm_state_size, mixer.chunk_size,
                   mixer.conv1d.kernel_size[0])

    def parts(self, zxbcdt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """z, xBC and dt: the views of the in_proj output (or its gradient) `in_proj` writes them in."""
        return zxbcdt[..., :self.d], zxbcdt[..., self.d:self.d + self.C], zxbcdt[..., self.d + self.C:]

    def conv_parts(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x, B and C: the views of the conv output (or its gradient)."""
        gn = self.G * self.N
        return xbc[..., :self.d], xbc[..., self.d:self.d + gn], xbc[..., self.d + gn:]

    def per_token(self) -> tuple[int, ...]:
        """(b, H, nc, Q): the float32 shape of dt and the cumulative decay the chunked scan keeps a token."""
        return (self.b, self.H, self.nc, self.Q)

    def states(self) -> tuple[int, ...]:
        return (self.b, self.nc, self.H, self.P, self.N)

    def chunk_squares(self) -> tuple[int, ...]:
        return (self.b, self.nc, self.G, self.Q, self.Q)


F32 = torch.float32


def _kernel(name: str, reads: tuple[torch.Tensor, ...], writes: list[tuple[tuple[int, ...], torch.dtype]],
            flops: int = 0, into: tuple[torch.Tensor, ...] = ()) -> list[torch.Tensor]:
    """One kernel reading `reads` and writing fresh tensors of `writes`' shapes and dtypes (returned) and the
    existing `into` (views of a buffer it fills in place), whose products do `flops`: recorded as one op of the
    count (workload/count.py), compute-bound where it has products, memory-bound where it has none."""
    with _one_kernel(name, reads, flops):
        made = [reads[0].new_empty(shape, dtype=dtype) for shape, dtype in writes]
        _kernel_writes(*made, *into)
    return made


class _Scanned(NamedTuple):
    """What the conv and the scan's first four kernels make (`_forward_kernels`): the conv's output (xBC) and its
    x, B and C, dt and the cumulative decay dA (float32), the chunk states passed along and C·Bᵀ (float32)."""

    xbc: torch.Tensor
    x: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    dt: torch.Tensor
    dA: torch.Tensor
    states: torch.Tensor
    CB: torch.Tensor


def _forward_kernels(shape: _Shape, zxbcdt: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                     dt_bias: torch.Tensor, A: torch.Tensor, recompute: bool) -> _Scanned:
    """The conv and the scan's first four kernels, the forward's (`recompute` False: states written in the
    inputs' dtype after the chunks are passed) or the backward's recomputation of them (float32 states)."""
    s, dtype = shape, zxbcdt.dtype
    _, xbc, dt = s.parts(zxbcdt)
    conv = tuple(t for t in (conv_weight, conv_bias) if t is not None)
    (xbc_conv,) = _kernel("causal_conv1d_fwd", (xbc, *conv), [(xbc.shape, dtype)], 2 * s.T * s.C * s.K)
    x, B, C = s.conv_parts(xbc_conv)
    dt_out, dA = _kernel("chunk_cumsum_fwd", (dt, A, dt_bias), [(s.per_token(), F32)] * 2)
    (states,) = _kernel("chunk_state_fwd", (x, B, dt_out, dA), [(s.states(), F32)], 2 * s.T * s.d * s.N)
    passed, _ = _kernel("state_passing_fwd", (states, dA[..., -1]),
                        [(s.states(), F32 if recompute else dtype), ((s.b, s.H, s.P, s.N), F32)])
    (CB,) = _kernel("bmm_chunk_fwd", (C, B), [(s.chunk_squares(), F32)], 2 * s.T * s.Q * s.G * s.N)
    return _Scanned(xbc, x, B, C, dt_out, dA, passed, CB)


class _Scan(torch.autograd.Function):
    """`mamba_split_conv1d_scan_combined` as Megatron-core calls it (no norm or out_proj weights): the conv and
    the chunked scan, the scan's output gated by silu(z) in its last kernel; saves zxbcdt and the output before
    the gate."""

    @staticmethod
    def forward(ctx: Any, shape: _Shape, zxbcdt: torch.Tensor, conv_weight: torch.Tensor,
                conv_bias: torch.Tensor | None, dt_bias: torch.Tensor, A: torch.Tensor, D: torch.Tensor
                ) -> torch.Tensor:
        s, dtype = shape, zxbcdt.dtype
        z = s.parts(zxbcdt)[0]
        k = _forward_kernels(s, zxbcdt, conv_weight, conv_bias, dt_bias, A, recompute=False)
        out, out_x = _kernel("chunk_scan_fwd", (k.CB, k.x, k.dt, k.dA, k.C, k.states, D, z),
                             [((s.b, s.s, s.d), dtype)] * 2, 2 * s.T * s.d * s.N + 2 * s.T * s.Q * s.d)
        ctx.shape = shape
        ctx.save_for_backward(zxbcdt, conv_weight, conv_bias, out_x, A, D, dt_bias)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        s = ctx.shape
        zxbcdt, conv_weight, conv_bias, out_x, A, D, dt_bias = ctx.saved_tensors
        dtype = zxbcdt.dtype
        z = s.parts(zxbcdt)[0]
        k = _forward_kernels(s, zxbcdt, conv_weight, conv_bias, dt_bias, A, recompute=True)
        x, B, C, dt, dA, CB = k.x, k.B, k.C, k.dt, k.dA, k.CB
        with _one_kernel("chunk_scan_bwd_dz", (grad, out_x, z, x, D), 0):
            dzxbcdt = zxbcdt.new_empty(zxbcdt.shape)  # the in_proj output's gradient, filled part by part
            dz, dxbc_conv_target, ddt = s.parts(dzxbcdt)
            dout = grad.new_empty((s.b, s.s, s.d))
            _kernel_writes(dz, dout)
        (dstates,) = _kernel("chunk_scan_bwd_dstates", (C, dA, dout), [(s.states(), F32)], 2 * s.T * s.d * s.N)
        dstates_in, ddA_chunk, states_in = _kernel(
            "state_passing_bwd", (k.states, dA[..., -1], dstates),
            [(s.states(), dtype), ((s.b, s.H, s.nc), F32), (s.states(), dtype)])
        with _one_kernel("chunk_scan_chunk_state_bwd_dx", (x, dt, dA, B, CB, dout, dstates_in, D),
                         2 * s.T * s.d * s.N + 2 * s.T * s.Q * s.d):
            dxbc = k.xbc.new_empty(k.xbc.shape)  # the conv output's gradient, which the conv's backward reads
            dx, dB_part, dC_part = s.conv_parts(dxbc)
            ddt_scan, dD = dA.new_empty(s.per_token()), D.new_empty(D.shape)
            _kernel_writes(dx, ddt_scan, dD)
        dB, _ = _kernel("chunk_state_bwd_db", (x, dt, dA, dstates_in, B),
                        [((s.b, s.s, s.G, s.N), F32), (s.per_token(), F32)], 2 * s.T * s.d * s.N)
        dC, _ = _kernel("chunk_scan_bwd_dC", (states_in, dA, dout, C),
                        [((s.b, s.s, s.G, s.N), F32), (s.per_token(), F32)], 2 * s.T * s.d * s.N)
        (dCB,) = _kernel("chunk_scan_bwd_dcb", (x, dt, dA, dout), [(s.chunk_squares(), F32)], 2 * s.T * s.Q * s.d)
        _kernel("bmm_chunk_bwd", (C, dCB, dB), [], 2 * s.T * s.Q * s.G * s.N, into=(dB_part,))
        _kernel("bmm_chunk_bwd", (B, dCB, dC), [], 2 * s.T * s.Q * s.G * s.N, into=(dC_part,))
        (ddA,) = _kernel("chunk_scan_bwd_ddAcs_stable", (x, dt, dA, dout, CB), [(s.per_token(), F32)],
                         2 * s.T * s.Q * s.d)
        dA_out, ddt_bias = _kernel("chunk_cumsum_bwd", (ddA, ddA_chunk, ddt_scan, s.parts(zxbcdt)[2], A, dt_bias),
                                [(A.shape, A.dtype), (dt_bias.shape, dt_bias.dtype)], into=(ddt,))
        conv = tuple(t for t in (conv_weight, conv_bias) if t is not None)
        conv_grads = _kernel("causal_conv1d_bwd", (k.xbc, *conv, dxbc), [(t.shape, t.dtype) for t in conv],
                             4 * s.T * s.C * s.K, into=(dxbc_conv_target,))
        return None, dzxbcdt, conv_grads[0], conv_grads[1] if conv_bias is not None else None, ddt_bias, dA_out, dD


class _GroupNorm(torch.autograd.Function):
    """mamba_ssm's grouped RMSNorm (layernorm_gated.py `LayerNormFn`, z None, as Megatron-core calls it on the
    gated scan output): one kernel each way, saving its input and its float32 statistics."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
        statistics = (x.shape[:-1].numel() * groups,)  # a float32 reciprocal deviation a token and group
        out, rstd = _kernel("layer_norm_fwd", (x, weight), [(x.shape, x.dtype), (statistics, F32)])
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, rstd = ctx.saved_tensors
        dx, dweight = _kernel("layer_norm_bwd", (grad, x, weight, rstd), [(x.shape, x.dtype), (weight.shape,
                                                                                          weight.dtype)])
        return dx, dweight, None


def counted_mixers(block: nn.Module) -> None:
    """Run every Mamba-2 mixer of `block` as `counted_mixer`."""
    for module in block.modules():
        if is_mamba2_mixer(module):
            module.forward = functools.partial(counted_mixer, module, module.forward)
