"""ChaCha20 (RFC 8439) as torch tensor operations: a keyed, counter-based generator of Gaussian
noise that runs on the device holding the parameters.

Why by hand: the noise must come from a generator keyed by ≥ 128 bits of secret entropy.
torch's device generators (Philox on CUDA) take a 64-bit seed, so 2^64 seeds could be searched
by whoever sees two checkpoints; numpy's PCG64 is keyed well but runs on the host, and drawing
hundreds of millions of normals there and copying them over is the serial part of a GPU step
(docs/scaling.md). No maintained library offers a ≥ 128-bit-keyed Gaussian generator on a GPU,
so this module implements the ChaCha20 block function (a 256-bit key, a 96-bit nonce and a
32-bit block counter, 20 rounds) with integer tensor operations that run unchanged on any torch
device, checked against RFC 8439's test vector and against the ``cryptography`` package.

Each block gives 16 32-bit words; two words make one 53-bit uniform in (0, 1), and Box–Muller
turns two uniforms into two standard normals, computed in float64 (8 normals a block). The
uniforms are never 0, so the normals are finite, and 53-bit uniforms put the largest value at
about 8.6 standard deviations.

Draw ``k`` of a run uses nonce ``(k mod 2^32, k >> 32, purpose)`` and block counters from 0, so
no (nonce, counter) pair is ever used twice under one key; the state to checkpoint (for a seeded
run) is the draw count alone.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Sequence

import numpy as np
import torch

from userdp.engine.noise.flat import add_piece, check_wide, flat_views, zeros_for_noise
from userdp.errors import UserError

_NO_TRITON: str | None = None  # why the Triton kernel cannot be imported here
try:  # the CUDA kernel is written in Triton, which CUDA builds of torch bring (the CPU wheel does not)
    from userdp.engine.noise import chacha_triton
except Exception as exc:  # noqa: BLE001 - a missing or broken triton: the kernel's status says why
    chacha_triton, _NO_TRITON = None, f"no triton: {type(exc).__name__}: {str(exc)[:120]}"

_MASK = 0xFFFFFFFF
_CONSTANTS = (0x61707865, 0x3320646E, 0x79622D32, 0x6B206574)  # "expand 32-byte k"
_SLAB_BLOCKS = 1 << 20  # blocks per pass (8M normals; ~1 GB of int64 temporaries at most)
_VECTOR, _SCALAR = 0, 1  # the nonce's purpose word: model-sized draws, scalar draws


def _rotl(x: torch.Tensor, n: int) -> torch.Tensor:
    return ((x << n) | (x >> (32 - n))) & _MASK


def _quarter(s: list, a: int, b: int, c: int, d: int) -> None:
    s[a] = (s[a] + s[b]) & _MASK
    s[d] = _rotl(s[d] ^ s[a], 16)
    s[c] = (s[c] + s[d]) & _MASK
    s[b] = _rotl(s[b] ^ s[c], 12)
    s[a] = (s[a] + s[b]) & _MASK
    s[d] = _rotl(s[d] ^ s[a], 8)
    s[c] = (s[c] + s[d]) & _MASK
    s[b] = _rotl(s[b] ^ s[c], 7)


def _words(ctr: torch.Tensor, fixed: torch.Tensor) -> torch.Tensor:
    """The block function on tensors: ``fixed`` holds the 16 input words (word 12, the counter,
    is replaced by ``ctr``); returns ``[len(ctr), 16]`` output words."""
    init = [ctr if i == 12 else fixed[i].expand_as(ctr) for i in range(16)]
    s = list(init)
    for _ in range(10):
        _quarter(s, 0, 4, 8, 12)
        _quarter(s, 1, 5, 9, 13)
        _quarter(s, 2, 6, 10, 14)
        _quarter(s, 3, 7, 11, 15)
        _quarter(s, 0, 5, 10, 15)
        _quarter(s, 1, 6, 11, 12)
        _quarter(s, 2, 7, 8, 13)
        _quarter(s, 3, 4, 9, 14)
    return torch.stack([(x + y) & _MASK for x, y in zip(s, init, strict=True)], dim=1)


_COMPILED: dict = {}  # device type -> (the slab kernel, its status)


def _slab_eager(ctr: torch.Tensor, fixed: torch.Tensor) -> torch.Tensor:
    """Blocks ``ctr`` -> their float64 normals: the block function and the normals transform."""
    return _normals_from_blocks(_words(ctr, fixed))


#: how far the compiled normals may sit from the eager ones, in float64 ulps of their pair's radius r
#: (Box–Muller's r cos θ, r sin θ): the transcendental functions (log, sqrt, sin, cos) differ between
#: libm and a compiler's code by an ulp or two (Inductor's CPU code: 5,351 of 524,288 normals, at most
#: 4e-16 relative). Relative to r, not to the normal itself: a SIMD cosine of an angle near π/2 is
#: accurate to an ulp of 1, not of its tiny result (numpy's, under Triton's interpreter, was 4e5
#: ulps of a 1e-10 normal). The integer part needs no tolerance of its own: a wrong bit anywhere in
#: ChaCha's 20 rounds changes the whole block (avalanche), which moves its eight normals by O(1), far
#: outside this bound; float32 arithmetic anywhere (1e-7) is as far outside it.
NORMALS_ULPS = 16

#: the longest the kernel's build (trace, compile, check) may take before the run goes on eager
COMPILE_TIMEOUT_S = float(os.environ.get("USERDP_COMPILE_TIMEOUT", "300"))


#: blocks the check runs (524,288 normals): a few milliseconds on a GPU
CHECK_BLOCKS = 1 << 16


def _check_compiled(compiled, device: torch.device) -> str | None:
    """None when ``compiled`` matches the eager slab on :data:`CHECK_BLOCKS` blocks within
    :data:`NORMALS_ULPS`; else why not."""
    ctr = torch.arange(1, 1 + CHECK_BLOCKS, dtype=torch.int64, device=device)
    fixed = torch.arange(7, 7 + 16 * 977, 977, dtype=torch.int64, device=device)
    got, ref = compiled(ctr, fixed), _slab_eager(ctr, fixed)
    if got.shape != ref.shape or got.dtype != ref.dtype or not bool(torch.isfinite(got).all()):
        return "the compiled kernel's output differs in shape, dtype or finiteness"
    rel = float(normals_error(got, ref))
    if rel > NORMALS_ULPS * 2.0**-52:
        return (
            f"the compiled normals differ from the eager ones by {rel:.3g} of their pair's radius "
            f"(> {NORMALS_ULPS} ulps)"
        )
    return None


def normals_error(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """The largest ``|got - ref|`` over Box–Muller pairs, each relative to the pair's radius in
    ``ref`` (:data:`NORMALS_ULPS`)."""
    radius = torch.hypot(ref[0::2], ref[1::2]).clamp(min=1e-300).repeat_interleave(2)
    return ((got - ref).abs() / radius).max()


def _triton_slab(device: torch.device) -> tuple:
    """``(kernel, None)`` when the hand-written Triton kernel (:mod:`userdp.engine.noise.chacha_triton`)
    builds and passes :func:`_check_compiled` on ``device``; else ``(None, why not)``."""
    if chacha_triton is None:
        return None, _NO_TRITON
    try:
        why = _check_compiled(chacha_triton.slab, device)
    except Exception as exc:  # noqa: BLE001 - reported in the status, never silent
        return None, f"{type(exc).__name__}: {str(exc)[:160]}"
    return (chacha_triton.slab, None) if why is None else (None, why)


def _build(device: torch.device, triton: bool) -> tuple:
    """The fastest kernel that passes :func:`_check_compiled`: the Triton kernel (``triton``: on
    CUDA), else ``torch.compile`` of the tensor code, else the eager code; the status says which
    and why the faster ones were not taken."""
    refused = None  # why the Triton kernel was not taken (None: not tried)
    if triton:
        kernel, why = _triton_slab(device)
        if kernel is not None:
            return kernel, "triton"
        refused = f"the Triton kernel refused: {why}"
    try:
        compiled = torch.compile(_slab_eager, dynamic=True)
        why = _check_compiled(compiled, device)
        if why is None:
            return compiled, "compiled" if refused is None else f"compiled ({refused})"
    except Exception as exc:  # noqa: BLE001 - reported, not swallowed: the status says why
        why = f"torch.compile failed: {type(exc).__name__}: {str(exc)[:160]}"
    return _slab_eager, f"eager ({'; '.join(w for w in (why, refused) if w)})"


def compile_kernel(
    device: torch.device, *, force: bool = False, timeout: float | None = None, triton: bool | None = None
) -> tuple:
    """``(kernel, status)``: the slab kernel on CUDA is the hand-written Triton kernel
    (:mod:`userdp.engine.noise.chacha_triton`), else :func:`_slab_eager` fused by ``torch.compile``
    (eagerly it is about 2,000 small kernels a slab: 0.42 s against 0.016 s for 124M normals on an
    H100), each used only after its normals matched the eager function's within
    :data:`NORMALS_ULPS` on a test input; the eager function elsewhere. Built once per process and
    device type, within ``timeout`` seconds (:data:`COMPILE_TIMEOUT_S`; past it the run goes on
    eager). The status is ``"triton"``, ``"compiled"`` (with why the Triton kernel was not taken)
    or ``"eager (reason)"``, logged and recorded in the privacy record, never a silent fallback.
    ``force`` builds on any device (tests); ``triton`` tries the Triton kernel first (default: on
    CUDA)."""
    key = device.type
    if key in _COMPILED and not force:
        return _COMPILED[key]
    if device.type != "cuda" and not force:
        out = (_slab_eager, f"eager ({device.type}: compiled only on CUDA)")
    else:
        limit = COMPILE_TIMEOUT_S if timeout is None else timeout
        box: list = []
        use_triton = device.type == "cuda" if triton is None else bool(triton)
        worker = threading.Thread(
            target=lambda: box.append(_build(device, use_triton)), daemon=True, name="userdp-chacha-compile"
        )
        worker.start()
        worker.join(limit)
        out = box[0] if box else (_slab_eager, f"eager (the kernel's compile did not finish in {limit:.0f} s)")
    if not force:
        _COMPILED[key] = out
    return out


def _block_fn(device: torch.device):
    """The block function alone (:func:`chacha20_blocks`, the keystream tests): eager."""
    return _words


def chacha20_blocks(
    key: Sequence[int], nonce: Sequence[int], counter: int, n: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """``n`` ChaCha20 blocks with block counters ``counter, counter + 1, ...``.

    Args:
        key: eight 32-bit words (the 256-bit key, little-endian words as in RFC 8439).
        nonce: three 32-bit words.
        counter: the first block counter (``counter + n`` must stay below 2^32).
        n: how many blocks.
        device: where to compute.

    Returns:
        An int64 tensor ``[n, 16]`` of 32-bit words (the serialized block, word by word).

    Raises:
        ValueError: a key or nonce of the wrong length, or counters past 2^32.
    """
    if len(key) != 8 or len(nonce) != 3:
        raise ValueError("ChaCha20 needs an 8-word key and a 3-word nonce")
    if counter < 0 or counter + n > 1 << 32:
        raise ValueError("ChaCha20 block counters must stay below 2^32")
    dev = torch.device(device)
    ctr = torch.arange(counter, counter + n, dtype=torch.int64, device=dev)
    return _block_fn(dev)(ctr, _fixed_words(key, nonce, dev))


def _fixed_words(key: Sequence[int], nonce: Sequence[int], dev: torch.device) -> torch.Tensor:
    """The 16 input words (the counter word 0) on ``dev``: pinned and non-blocking on CUDA (a
    pageable copy would wait for the device), once per draw."""
    fixed = torch.tensor(
        [*_CONSTANTS, *(int(k) & _MASK for k in key), 0, *(int(x) & _MASK for x in nonce)], dtype=torch.int64
    )
    return fixed.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else fixed.to(dev, non_blocking=True)


#: Box-Muller's radius is sqrt(-2 ln u1): u1 is drawn with 85 bits (53 + 32), so the radius is
#: bounded by sqrt(2 * 85 ln 2) = 10.85; the Gaussian mass it drops is 2^-85 per pair of normals,
#: added to delta by :func:`tail_delta` (the 53-bit u1 of before dropped 2^-53 a pair, which at
#: GPT-2 size and epsilon = 8 would have added about 0.02 to delta over 1,000 steps).
TAIL_MASS_PER_PAIR = 2.0**-85


def tail_delta(num_coordinates: int, steps: int, epsilon: float, mass_per_pair: float = TAIL_MASS_PER_PAIR) -> float:
    """What the bounded radius adds to delta: the run's noise differs from exact Gaussians with
    probability at most p = steps * ceil(d/2) * 2^-85 (total variation, union bound), and a
    mechanism within total variation p of an (epsilon, delta)-DP one is
    (epsilon, delta + (1 + e^epsilon) p)-DP."""
    if steps <= 0 or num_coordinates <= 0:
        return 0.0
    p = steps * math.ceil(num_coordinates / 2) * mass_per_pair
    return p * (1.0 + math.exp(min(float(epsilon), 700.0)))


def _normals_from_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """Eight float64 standard normals per block: Box–Muller, each pair from four 32-bit words:
    u1 from 85 bits (27 + 26 + 32) in (0, 1), the angle from 32 bits."""
    w = blocks.reshape(-1, 4)
    hi = ((w[:, 0] >> 5) * 67108864 + (w[:, 1] >> 6)).to(torch.float64)  # 53 bits
    lo = (w[:, 2].to(torch.float64) + 0.5) / 4294967296.0  # (0, 1), 32 bits
    u1 = (hi + lo) / 9007199254740992.0  # (0, 1]: at least 2^-86, never 0
    r = torch.sqrt(-2.0 * torch.log(u1))
    theta = (2.0 * math.pi / 4294967296.0) * (w[:, 3].to(torch.float64) + 0.5)
    return torch.stack([r * torch.cos(theta), r * torch.sin(theta)], dim=1).reshape(-1)


class ChaChaNoise:
    """i.i.d. N(0, std²) noise drawn on the parameters' device from ChaCha20 keyed by 256 bits.

    The same interface as :class:`userdp.engine.noise.gaussian.GaussianNoise` (``like``, ``scalar``,
    ``state_dict``): the noise mechanism does not know which source it has.

    Args:
        key_material: an integer of at least 128 bits of entropy (256 used).
        seeded: whether the key came from a user-given seed (then the state may be saved).
    """

    algorithm = (
        "ChaCha20 (RFC 8439, 256-bit key, 20 rounds) in torch on the parameters' device; "
        "Box-Muller in float64 on an 85-bit radius uniform and a 32-bit angle (radius <= 10.85: "
        "the dropped tail, 2^-85 a pair, is added to delta); one nonce per draw"
    )

    #: the Gaussian mass the bounded radius drops, per pair of normals (:func:`tail_delta`)
    tail_mass_per_pair = TAIL_MASS_PER_PAIR
    #: the largest |z| a draw can give: Box-Muller's radius, sqrt(-2 ln u1) with u1 >= 2^-86
    max_normal = {"float64": math.sqrt(2 * 86 * math.log(2))}

    def __init__(self, key_material: int, *, seeded: bool):
        ss = np.random.SeedSequence(int(key_material), spawn_key=(0x63686163,), pool_size=8)
        self._key = [int(x) for x in ss.generate_state(8, np.uint32)]
        self.seeded = bool(seeded)
        self._draws = 0

    def prepare(self, device) -> str:
        """Build (compile and check) the slab kernel for ``device`` now, when the run is built,
        not inside its first step; returns the status (``compiled`` or ``eager (reason)``)."""
        return compile_kernel(torch.device(device))[1]

    def _slabs(self, count: int, device, purpose: int):
        """The next draw: ``count`` float64 normals as ``(offset, slab)`` pieces of at most 8M,
        computed on ``device``. The draw's nonce is taken now (also for ``count`` = 0), so every
        call is one draw whether or not its pieces are read."""
        k = self._draws
        self._draws += 1
        nonce = (k & _MASK, (k >> 32) & _MASK, purpose)
        blocks = -(-count // 8)

        dev = torch.device(device)
        kernel = compile_kernel(dev)[0]
        fixed = _fixed_words(self._key, nonce, dev)

        def pieces():
            for start in range(0, blocks, _SLAB_BLOCKS):
                n = min(_SLAB_BLOCKS, blocks - start)
                if start + n > 1 << 32:
                    raise ValueError("ChaCha20 block counters must stay below 2^32")
                ctr = torch.arange(start, start + n, dtype=torch.int64, device=dev)
                yield start * 8, kernel(ctr, fixed)[: count - start * 8]

        return pieces()

    def add_(self, tensors: Sequence[torch.Tensor], std: float) -> Sequence[torch.Tensor]:
        """Add one draw of N(0, std² I) over the concatenation of ``tensors`` to them, in place,
        computed on the first tensor's device a slab (8M normals) at a time: no model-sized
        noise buffer. Normals are float64, scaled in float64, added in each tensor's dtype
        (float32 or float64).

        Returns:
            ``tensors``.

        Raises:
            ValueError: a tensor narrower than float32, or not contiguous.
        """
        if not tensors:
            return tensors
        check_wide(tensors)
        flats, offsets = flat_views(tensors)
        for lo, z in self._slabs(offsets[-1], tensors[0].device, _VECTOR):
            add_piece(flats, offsets, z.mul_(float(std)), lo)
        return tensors

    def pieces(self, total: int, dtypes: Sequence[torch.dtype], device):
        """The float64 standard normals :meth:`add_` would draw over ``total`` numbers, as
        ``(offset, slab)`` in increasing order, computed on ``device``: one draw (one nonce), for a
        distribution that scatters the draw (:class:`userdp.engine.noise.flat.DrawCursor`)."""
        return self._slabs(int(total), device, _VECTOR)

    def like(self, tensors: Sequence[torch.Tensor], std: float) -> list[torch.Tensor]:
        """One draw of N(0, std² I) shaped like ``tensors`` (float32, float64 where a tensor is
        float64; on each tensor's device): :meth:`add_` on zeros."""
        return list(self.add_(zeros_for_noise(tensors), std))

    def scalar(self, std: float) -> float:
        """One draw of N(0, std²) in float64 (the adaptive-clipping count query)."""
        _, z = next(iter(self._slabs(1, "cpu", _SCALAR)))
        return float(z[0]) * float(std)

    def state_dict(self) -> dict:
        """The draw count (seeded runs only: the key is the secret)."""
        if not self.seeded:
            raise RuntimeError("an unseeded noise generator's state is secret and is never saved")
        return {"chacha20_draws": self._draws}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output.

        Raises:
            userdp.errors.UserError: a state of another generator.
        """
        if not (isinstance(state, dict) and "chacha20_draws" in state):
            raise UserError(
                "the checkpoint's noise generator state is of another generator (a run made on "
                "another device type): resume on the device the seeded run began on"
            )
        self._draws = int(state["chacha20_draws"])
