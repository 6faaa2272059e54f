"""The host noise generator (userdp.engine.noise.ziggurat, userdp.engine.noise.aes): numpy's float32
ziggurat, compiled, over AES-256-CTR words. Its units are numpy's (over PCG64DXSM's words it gives
``Generator.standard_normal`` bit for bit, slow paths included); its words are the cipher's keystream,
read anywhere again; its numbers do not depend on how a draw is split, resume from a saved position,
and pass the statistical tests of a standard normal (fixed seeds, tolerances of 5-6 standard errors
or p > 1e-4)."""

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from scipy import stats

from userdp.engine.noise import aes, ziggurat, ziggurat_kernel


def test_over_pcg64s_words_it_is_numpys_standard_normal_bit_for_bit():
    n = 300_000
    words = np.random.PCG64DXSM(123).random_raw(n).view(np.uint32)  # numpy's next_uint32: low word first
    out = np.empty(n, np.float32)
    used = ziggurat.fill(words, out, numpy_tail=True)
    want = np.random.Generator(np.random.PCG64DXSM(123)).standard_normal(n, dtype=np.float32)
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))  # every bit, signed zeros too
    assert n < used <= words.size  # the wedges and the tail took words of their own
    assert (np.abs(out) > ziggurat.R).sum() > 20  # the tail beyond r was drawn (expected ~77)
    short = np.full(n, 7.0, np.float32)
    assert ziggurat.fill(words[: n - 1], short) == -1  # too few words: said, not guessed
    compiled = ziggurat_kernel.fill(words[:10], short[:10], True, *ziggurat.new_scratch())
    assert compiled == 10  # the compiled kernel itself
    # the kernel the noise uses differs only in the tail: the same numbers up to the first normal beyond r
    ours = np.empty(n, np.float32)
    assert ziggurat.fill(words, ours) > 0
    first = int(np.flatnonzero(np.abs(want) > ziggurat.R)[0])
    assert np.array_equal(ours[:first].view(np.uint32), want[:first].view(np.uint32))
    assert abs(ours[first]) > ziggurat.R and ours[first] != want[first]


def test_the_tail_reaches_beyond_numpys_bound():
    """numpy's float32 tail stops at r + 24 ln 2 / r = 8.21 (24-bit uniforms); this kernel's uniforms
    have 85 bits. A word stream built to take the tail with uniforms near 0 gives, here, a normal
    beyond 8.21, and with numpy's tail the largest numpy can give."""
    first = np.uint32(int(ziggurat.K[0]) << 9)  # layer 0, rejected by the fast path: the tail
    ours = np.empty(1, np.float32)
    # x from the uniform 2^-57 (x = 39.5 / r = 10.8), accepted by the smallest uniform, 2^-86
    words = np.array([first, 0, 0, 1 << 28, 0, 0, 0], dtype=np.uint32)
    assert ziggurat.fill(words, ours) == 7
    assert ziggurat.NUMPY_MAX + 6 < abs(ours[0]) <= ziggurat.TAIL_MAX
    theirs = np.empty(1, np.float32)
    ones = np.uint32(0xFFFFFFFF)  # 1 - u = 2^-24: the largest numpy's tail can reach, then accepted
    assert ziggurat.fill(np.array([first, ones, ones], dtype=np.uint32), theirs, numpy_tail=True) == 3
    assert abs(theirs[0]) == pytest.approx(ziggurat.NUMPY_MAX, rel=1e-6)


def _by_hand(words: np.ndarray, n: int) -> np.ndarray:
    """The algorithm of the module docstring in plain Python, one word at a time (85-bit tail): the
    reference the compiled kernel, which works a block of words at a time, is held to."""
    k, w, f = ziggurat.K, ziggurat.W, ziggurat.F
    r32, scale = np.float32(ziggurat.R), np.float32(1.0 / 16777216.0)
    out, p = np.empty(n, np.float32), 0

    def uniform(a, b, c):  # 85 bits, in float64, never 0
        hi = float((int(a) >> 5) * 67108864 + (int(b) >> 6))
        return (hi + (float(c) + 0.5) / 4294967296.0) / 9007199254740992.0

    for i in range(n):
        while True:
            r = int(words[p])
            p += 1
            layer, rabs = r & 0xFF, (r >> 9) & 0x7FFFFF
            x = np.float32(np.float32(rabs) * w[layer])
            x = -x if r & 0x100 else x
            if rabs < k[layer]:
                out[i] = x
                break
            if layer == 0:
                while True:
                    x64 = -np.log(uniform(*words[p : p + 3])) / float(r32)
                    y64 = -np.log(uniform(*words[p + 3 : p + 6]))
                    p += 6
                    if y64 + y64 > x64 * x64:
                        v = np.float32(float(r32) + x64)
                        out[i] = -v if (rabs >> 8) & 1 else v
                        break
                break
            u = np.float32(np.float32(int(words[p]) >> 8) * scale)
            p += 1
            if float(np.float32((f[layer - 1] - f[layer]) * u + f[layer])) < np.exp(-0.5 * float(x) * float(x)):
                out[i] = x
                break
    return out


def test_a_block_boundary_inside_a_slow_path_changes_no_number():
    """The kernel takes its words a block at a time (its values and flags kept in cache), and a slow
    path may read past its block. Words built so that the tail and a wedge begin at the last words
    of blocks, and so that a block begins inside a slow path, give the plain, one-word-at-a-time
    algorithm's numbers, bit for bit, and its count of words used."""
    block = ziggurat_kernel.BLOCK
    words = np.random.PCG64DXSM(7).random_raw(2 * block).view(np.uint32)[: 3 * block + 3000].copy()
    tail = np.uint32(int(ziggurat.K[0]) << 9)  # layer 0, rejected by the fast path: the tail
    wedge = np.uint32((int(ziggurat.K[200]) << 9) | 200)  # layer 200 at its fast path's bound: the wedge
    words[block - 1] = tail  # six uniform words in the next block
    words[2 * block - 1] = wedge  # its uniform is the next block's first word
    words[2 * block - 3] = tail  # a block that begins three words into a tail's uniforms
    n = 3 * block - 200
    got = np.empty(n, np.float32)
    used = ziggurat.fill(words, got, scratch=ziggurat.new_scratch())
    want = _by_hand(words, n)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert used == ziggurat.fill(words, np.empty(n, np.float32))  # its own scratch: the same
    assert np.abs(got).max() > ziggurat.R  # the tail was drawn


def test_the_tables_are_the_ziggurats():
    assert ziggurat.K[1] == 0 and ziggurat.F[0] == 1.0 and np.all(np.diff(ziggurat.F) < 0)
    assert np.all(np.diff(ziggurat.W[1:]) > 0) and ziggurat.W[-1] * (1 << 23) == pytest.approx(ziggurat.R, rel=1e-6)


def _stream(seed=5):
    return aes.CipherStream(np.random.SeedSequence(seed))


def test_the_words_are_the_aes_256_ctr_keystream_read_anywhere_again():
    s = _stream()
    want = np.frombuffer(
        Cipher(algorithms.AES(s._key), modes.CTR(bytes(16))).encryptor().update(bytes(4 * 4000)), dtype="<u4"
    )
    assert len(s._key) == 32  # a 256-bit key
    assert np.array_equal(s._words(1000), want[:1000])
    s._at = 1000
    assert np.array_equal(s._words(2999), want[1000:3999])
    for at in (3, 1001, 2222):  # a resumed stream reads the keystream again from its position
        s.state = {**s.state, "words": at}
        assert np.array_equal(s._words(500), want[at : at + 500])


def test_a_draw_is_the_same_numbers_however_it_is_split_or_resumed(monkeypatch):
    whole = _stream().standard_normal(np.empty(300_000, np.float32)).copy()
    split = _stream()
    parts = [split.standard_normal(np.empty(k, np.float32)).copy() for k in (1, 999, 70_000, 229_000)]
    assert np.array_equal(np.concatenate(parts), whole)
    monkeypatch.setattr(aes, "_SPARE", 1 << 30)  # 64 spare words a piece: most pieces run out and read more
    assert np.array_equal(_stream().standard_normal(np.empty(300_000, np.float32)), whole)
    monkeypatch.undo()
    a = _stream()
    a.standard_normal(np.empty(12_345, np.float32))
    saved = a.state
    after = a.standard_normal(np.empty(50_000, np.float32)).copy()
    b = _stream()
    b.state = saved
    assert np.array_equal(b.standard_normal(np.empty(50_000, np.float32)), after)
    assert not np.array_equal(_stream(6).standard_normal(np.empty(1000, np.float32)), whole[:1000])


@pytest.mark.parametrize("bad", [None, {"words": -1, "wide": {}}, {"words": 1.5, "wide": {}}, {"words": 3}])
def test_a_saved_position_of_another_layout_is_one_line(bad):
    from userdp.errors import UserError

    with pytest.raises(UserError, match="another layout"):
        _stream().state = bad


def test_its_normals_pass_the_tests_of_a_standard_normal():
    n = 4_000_000
    z = _stream(2026).standard_normal(np.empty(n, np.float32)).astype(np.float64)
    assert stats.kstest(z, "norm").pvalue > 1e-4
    assert abs(z.mean()) < 5 / np.sqrt(n) and abs(z.var() - 1) < 5 * np.sqrt(2 / n)
    assert abs(stats.skew(z)) < 5 * np.sqrt(6 / n) and abs(stats.kurtosis(z)) < 5 * np.sqrt(24 / n)
    edges = stats.norm.ppf(np.linspace(0, 1, 257)[1:-1])  # 256 cells of equal mass
    counts = np.bincount(np.searchsorted(edges, z), minlength=256)
    assert stats.chisquare(counts).pvalue > 1e-4
    for t in (2.0, 3.0, ziggurat.R, 4.5):  # the tails, the ziggurat's own tail beyond r among them
        p = 2 * stats.norm.sf(t)
        assert abs((np.abs(z) > t).mean() - p) < 6 * np.sqrt(p * (1 - p) / n), t
    assert abs(np.corrcoef(z[:-1], z[1:])[0, 1]) < 5 / np.sqrt(n)  # successive normals uncorrelated
    other = _stream(2027).standard_normal(np.empty(n, np.float32)).astype(np.float64)
    assert abs(np.corrcoef(z, other)[0, 1]) < 5 / np.sqrt(n)  # two keys: unrelated streams
