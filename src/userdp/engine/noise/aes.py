"""A keyed stream of standard normals on the host: AES-256 in counter mode, through the ziggurat.

The host source's streams (:class:`userdp.engine.noise.gaussian.GaussianNoise`) draw from this: a
256-bit key from the source's key material (its ``SeedSequence`` child: never stored for an unseeded
run), the block counter from 0, 16 bytes a block, encrypted by OpenSSL through ``cryptography`` (AES-NI
on every x86-64 CPU of the last decade; ARMv8's crypto extensions likewise; ``cryptography`` 50 and
later release the GIL while it encrypts, so the source's threads do so at once: before, they took
turns). A counter-mode cipher is
a pseudorandom function of the counter under the key, so the words are unpredictable to anyone
without the key, whatever else of the stream they see (a checkpoint of a seeded run holds the counter
alone). :func:`userdp.engine.noise.ziggurat.fill` turns the words into float32 normals, numpy's
ziggurat step for step. Float64 draws (for a float64 model) keep numpy's float64 ziggurat on
``PCG64DXSM`` keyed by a sibling child of the same key material.

The stream's position is the count of words used: a draw reads the keystream from there (the counter
block that holds it, then on), uses what its normals need and leaves the rest to the next, so no word
is used twice and the numbers do not depend on how a draw is split into pieces.
"""

from __future__ import annotations

import hashlib

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from userdp.engine.noise import ziggurat
from userdp.errors import UserError

ALGORITHM = (
    "AES-256-CTR (OpenSSL via cryptography) words through numpy's float32 ziggurat (Marsaglia & Tsang, "
    "256 layers; compiled by numba), its tail from 85-bit uniforms (no normal beyond 14.57); "
    "float64 draws: numpy PCG64DXSM's ziggurat"
)
_BLOCK = 16
_LABEL = b"userdp host noise stream, AES-256-CTR key\x00"
_WORDS = _BLOCK // 4
_PIECE = 1 << 16  # normals a piece: its words (280 KB) stay in the core's L2 beside the kernel's block
_SPARE = 16  # a piece reads 1/16 more words than normals, plus 64: it needs ~2.2% more (its rejects)
_MARGIN = _PIECE // _SPARE + 64
_ZEROS = bytes(4 * (_PIECE + _MARGIN + 2 * _WORDS))  # the plaintext of a piece, shared (read only)


class CipherStream:
    """One stream of standard normals (see the module docstring).

    Args:
        seed: the stream's ``numpy.random.SeedSequence`` (a child of the source's 256-bit key).
    """

    def __init__(self, seed: np.random.SeedSequence):
        key_seq, wide_seq = seed.spawn(2)
        # 256 bits of the key material's child, through SHA-256 (a SeedSequence mixes seeds well, but
        # is no cryptographic key derivation): the streams' AES keys are unrelated to each other
        self._key = hashlib.sha256(_LABEL + key_seq.generate_state(8, np.uint32).tobytes()).digest()
        self._wide = np.random.Generator(np.random.PCG64DXSM(wide_seq))
        self._scratch: tuple | None = None  # the kernel's (ziggurat.new_scratch), made on the first draw, reused
        self._seek(0)

    def _seek(self, at: int) -> None:
        """Stand at word ``at``: the keystream is read again from the block that holds it."""
        self._at = int(at)  # words of the keystream used
        self._start = self._end = (self._at // _WORDS) * _WORDS  # the words held: [start, end)
        self._enc = Cipher(
            algorithms.AES(self._key), modes.CTR((self._start // _WORDS).to_bytes(_BLOCK, "big"))
        ).encryptor()
        # the block that holds the position (grown once; the words held are its first end - start)
        self._held = np.frombuffer(self._enc.update(bytes(_BLOCK)), dtype="<u4").copy()
        self._end += _WORDS

    def _words(self, n: int) -> np.ndarray:
        """The next ``n`` words from the stream's position: those held, then on from the cipher where
        they end (one encryptor read in order: the keystream is never computed twice; one buffer,
        reused, so a piece costs no fresh memory)."""
        if self._at + n > self._end:
            kept = self._end - self._at
            size = -(-(n - kept) // _WORDS) * _WORDS  # whole blocks
            left = self._held[self._at - self._start : self._end - self._start]
            if self._held.size < kept + size + _WORDS:  # a piece's words at most (a retry's: more)
                self._held = np.empty(max(kept + size + _WORDS, _PIECE + _MARGIN + 2 * _WORDS), dtype=np.uint32)
            self._held[:kept] = left.copy()
            zeros = _ZEROS if len(_ZEROS) >= 4 * size else bytes(4 * size)
            self._enc.update_into(memoryview(zeros)[: 4 * size], self._held.data.cast("B")[4 * kept :])
            self._start, self._end = self._at, self._end + size
        return self._held[self._at - self._start : self._at - self._start + n]

    def standard_normal(self, out: np.ndarray, dtype=np.float32) -> np.ndarray:
        """Fill ``out`` with standard normals (numpy's ``Generator.standard_normal`` signature): a
        cache-sized piece at a time, each from the words after the last piece's."""
        if np.dtype(dtype) != np.float32:
            return self._wide.standard_normal(out=out, dtype=dtype)
        for lo in range(0, out.size, _PIECE):
            piece = out[lo : lo + _PIECE]
            margin = piece.size // _SPARE + 64
            if self._scratch is None:
                self._scratch = ziggurat.new_scratch()
            while (used := ziggurat.fill(self._words(piece.size + margin), piece, scratch=self._scratch)) < 0:
                margin *= 4  # ran out (rare): the same words from the same position, and more of them
            self._at += used
        return out

    @property
    def state(self) -> dict:
        """The stream's position: the keystream's words used and the float64 generator's state (the
        key is not in it: it is derived again from the key material)."""
        return {"words": int(self._at), "wide": dict(self._wide.bit_generator.state)}

    @state.setter
    def state(self, value: dict) -> None:
        at = value.get("words") if isinstance(value, dict) else None
        if not (isinstance(at, int) and not isinstance(at, bool) and at >= 0 and isinstance(value.get("wide"), dict)):
            raise UserError("the checkpoint's noise generator state has another layout (an older userdp)")
        self._seek(at)
        self._wide.bit_generator.state = value["wide"]
