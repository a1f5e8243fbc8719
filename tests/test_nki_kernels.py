"""The NKI kernels (kernels/splice.py, verify.py, rank_argmax.py) against their torch twins.

Every test runs each kernel under the NumPy interpreter (kernels/nki_interp.py). Where the real `nki` package
imports (a Neuron SDK host) the same tests also run under `nki.simulate` with NEURON_PLATFORM_TARGET_OVERRIDE=trn2;
here that parameter is skipped with its reason. Integer outputs are compared bit-exactly.
"""
import pytest
import torch

from nxdi_voxtral.kernels import nki_interp
from nxdi_voxtral.kernels.rank_argmax import combine_rank_argmax, describe_plan, rank_argmax_kernel, rank_argmax_torch
from nxdi_voxtral.kernels.splice import splice_kernel, splice_torch
from nxdi_voxtral.kernels.verify import greedy_accept_kernel, greedy_accept_torch, greedy_verify_kernel, greedy_verify_torch


def _real_nki():
    try:
        import nki
    except Exception:
        return None
    return None if getattr(nki, "IS_STUB", False) is True or not hasattr(nki, "simulate") else nki


REAL_NKI = _real_nki()


# nki.simulate cases exist only where the real `nki` imports (a Neuron SDK host), so they are not reported as skips
@pytest.fixture(params=["interpreter"] + (["nki.simulate"] if REAL_NKI is not None else []))
def sim(request, monkeypatch):
    if request.param == "interpreter":
        return nki_interp.simulate
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    return lambda handle: REAL_NKI.simulate(handle.real())


def gen(seed):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------- verify
def verify_case(b, k1, vocab, dtype, seed, accept=None, n_valid=None, ties=False):
    g = gen(seed)
    if ties:
        logits = torch.randint(0, 3, (b, k1, vocab), generator=g).to(dtype)  # many equal maxima
    else:
        logits = torch.randn(b, k1, vocab, generator=g).to(dtype)
    target = torch.argmax(logits, -1).to(torch.int32)
    cand = torch.cat([torch.randint(0, vocab, (b, 1), generator=g, dtype=torch.int32), target[:, :-1]], 1)
    if accept is not None:  # first mismatch at proposal `accept[i]` of row i
        for i, a in enumerate(accept):
            if a < k1 - 1:
                cand[i, a + 1] = (cand[i, a + 1] + 1) % vocab
    if n_valid is None:
        n_valid = torch.full((b,), k1 - 1, dtype=torch.int32)
    return cand, logits, torch.as_tensor(n_valid, dtype=torch.int32)


def check_verify(sim, cand, logits, n_valid):
    run = sim(greedy_verify_kernel)
    got = run(cand, logits, n_valid)
    want = greedy_verify_torch(cand, logits, n_valid)
    for g_, w in zip(got, want):
        assert g_.dtype == torch.int32 and torch.equal(g_, w), (g_, w)
    acc, bon = sim(greedy_accept_kernel)(cand, want[0], n_valid)
    _, acc_t, bon_t = greedy_accept_torch(cand, want[0], n_valid)
    assert torch.equal(acc, acc_t) and torch.equal(bon, bon_t)
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k1", [5, 16])
def test_verify_voxtral_shapes_all_and_none_accept(sim, dtype, k1):
    # V = 131072 / 4: the vocabulary shard of one rank at tp 4
    cand, logits, n_valid = verify_case(2, k1, 32768, dtype, seed=k1, accept=[k1 - 1, 0])
    t, acc, bonus = check_verify(sim, cand, logits, n_valid)
    assert acc.tolist() == [k1 - 1, 0]  # all accepted, none accepted
    assert bonus.tolist() == [int(t[0, k1 - 1]), int(t[1, 0])]


def test_verify_n_valid_below_k_and_random_cuts(sim):
    cand, logits, _ = verify_case(6, 8, 1000, torch.float32, seed=3, accept=[7, 5, 2, 7, 0, 4])
    n_valid = torch.tensor([3, 7, 7, 0, 7, 2], dtype=torch.int32)
    _, acc, _ = check_verify(sim, cand, logits, n_valid)
    assert acc.tolist() == [3, 5, 2, 0, 0, 2]


@pytest.mark.parametrize("vocab", [7, 8, 1000, 16385, 40000, 50001])
def test_verify_vocab_not_multiple_of_segment(sim, vocab):
    # 7: shorter than max8's minimum (padded); 16385 / 50001: a short last segment
    for b, k1 in ((1, 5), (3, 2)):
        cand, logits, n_valid = verify_case(b, k1, vocab, torch.float32, seed=vocab + b)
        check_verify(sim, cand, logits, n_valid)


def test_verify_ties_inside_and_across_segments(sim):
    k1, vocab = 16, 32768               # plan: 8 segments of 4096 per row
    assert describe_plan(k1, vocab)["segment"] == 4096
    logits = torch.zeros(1, k1, vocab)
    maxima = [(5, 9), (10, 20000), (4095, 4096), (0, 32767), (30000, 31000), (8191, 8192), (100, 100 + 4096 * 7)]
    for j, pos in enumerate(maxima):
        logits[0, j, list(pos)] = 3.0
    logits[0, len(maxima):, :] = torch.randint(0, 2, (k1 - len(maxima), vocab), generator=gen(1)).float()
    cand = torch.zeros(1, k1, dtype=torch.int32)
    t, _, _ = check_verify(sim, cand, logits, torch.tensor([k1 - 1], dtype=torch.int32))
    assert t[0, :len(maxima)].tolist() == [p[0] for p in maxima]  # first index, as torch.argmax
    # the same with random small-integer logits: ties everywhere
    cand, logits, n_valid = verify_case(3, 5, 5000, torch.float32, seed=7, ties=True)
    check_verify(sim, cand, logits, n_valid)


def test_verify_bf16_index_above_32767(sim):
    # bf16 represents integers exactly only up to 256: an index path in the logit dtype (cascaded_max's trap)
    # would turn 100001 into 99840 or 100352
    vocab = 131072
    logits = torch.randn(1, 5, vocab, generator=gen(2)).to(torch.bfloat16)
    for j, pos in enumerate([32767, 32768, 100001, 131071, 65535]):
        logits[0, j, pos] = 50.0
    target = torch.tensor([[32767, 32768, 100001, 131071, 65535]], dtype=torch.int32)
    cand = torch.cat([torch.tensor([[1]], dtype=torch.int32), target[:, :-1]], 1)
    t, acc, bonus = check_verify(sim, cand, logits, torch.tensor([4], dtype=torch.int32))
    assert torch.equal(t, target) and acc.tolist() == [4] and bonus.tolist() == [65535]


def test_verify_many_rows_and_batch_tiles(sim):
    # 130 x 2 = 260 argmax rows (3 row tiles), 130 batch rows (2 accept tiles); K = 0 (no proposals)
    cand, logits, n_valid = verify_case(130, 2, 64, torch.float32, seed=5)
    n_valid[::3] = 0
    check_verify(sim, cand, logits, n_valid)
    cand, logits, n_valid = verify_case(4, 1, 300, torch.bfloat16, seed=6)
    t, acc, bonus = check_verify(sim, cand, logits, torch.zeros(4, dtype=torch.int32))
    assert acc.tolist() == [0] * 4 and torch.equal(bonus, t[:, 0])


# ------------------------------------------------------------------------------------------ rank argmax
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rank_argmax_then_torch_combine_equals_full_argmax(sim, dtype):
    tp, shard = 4, 32768                                 # 131072 / 4
    logits = torch.randn(5, 2, tp * shard, generator=gen(9)).to(dtype)
    logits[0, 0, [shard + 7, 3 * shard + 7]] = 40.0      # tie across ranks 1 and 3 -> rank 1
    logits[1, 0, [3 * shard + 1, 3 * shard + 2]] = 40.0  # tie inside rank 3
    logits[2, 0, [7, 2 * shard - 1]] = 40.0              # ranks 0 and 1: the very first index wins
    logits[3, 1, :] = 1.0                                # every entry equal -> 0
    logits[4, 1, [shard - 1, shard]] = 40.0              # last of rank 0 vs first of rank 1
    run = sim(rank_argmax_kernel)
    values, index = [], []
    for r in range(tp):
        part = logits[..., r * shard:(r + 1) * shard]
        v, i = run(part.reshape(-1, shard))
        tv, ti = rank_argmax_torch(part)
        assert v.dtype == dtype and i.dtype == torch.int32
        assert torch.equal(v.reshape(tv.shape), tv) and torch.equal(i.reshape(ti.shape), ti)
        values.append(v.reshape(tv.shape))
        index.append(i.reshape(ti.shape))
    combined = combine_rank_argmax(torch.stack(values), torch.stack(index), shard)
    assert torch.equal(combined, torch.argmax(logits, -1).to(torch.int32))
    assert combined[0, 0] == shard + 7 and combined[2, 0] == 7 and combined[3, 1] == 0


def test_rank_argmax_odd_shapes(sim):
    for rows, vocab in ((1, 9), (3, 16384), (40, 16385), (129, 200)):
        x = torch.randint(-2, 2, (rows, vocab), generator=gen(rows)).float()  # ties
        v, i = sim(rank_argmax_kernel)(x)
        tv, ti = rank_argmax_torch(x)
        assert torch.equal(v, tv) and torch.equal(i, ti)


def test_rank_argmax_negative_infinity_rows(sim):
    x = torch.full((3, 100), float("-inf"))
    x[1, 50] = 0.0
    v, i = sim(rank_argmax_kernel)(x)
    tv, ti = rank_argmax_torch(x)
    assert torch.equal(i, ti) and torch.equal(v, tv)


# ----------------------------------------------------------------------------------------------- splice
def splice_case(t1, hidden, n_audio, n_pad, dtype, seed):
    g = gen(seed)
    embeds = torch.randn(t1, hidden, generator=g).to(dtype)
    audio = torch.randn(n_audio, hidden, generator=g).to(dtype)
    real = torch.randperm(t1 - 1, generator=g)[:n_audio - n_pad]
    positions = torch.cat([real, torch.full((n_pad,), t1 - 1)]).to(torch.int32)
    return embeds, audio, positions


def check_splice(sim, embeds, audio, positions, **kw):
    got = sim(splice_kernel)(embeds, audio, positions, **kw)
    want = splice_torch(embeds, audio, positions)
    t = embeds.shape[0] - 1
    assert got.dtype == embeds.dtype and got.shape == want.shape
    assert torch.equal(got[:t], want[:t])  # bit-exact; row T is scratch
    n_pad = int((positions == t).sum())
    if n_pad == 1:
        assert torch.equal(got[t], want[t])
    elif n_pad == 0:
        assert torch.equal(got[t], embeds[t])
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_splice_more_than_128_rows_and_partial_column_tile(sim, dtype):
    # A = 300 (3 blocks of <= 128), T+1 = 400 > 128, H = 100 with 48-element column tiles (100 = 48 + 48 + 4)
    embeds, audio, positions = splice_case(400, 100, 300, 20, dtype, seed=1)
    check_splice(sim, embeds, audio, positions, h_tile=48)
    check_splice(sim, embeds, audio, positions)  # default column tile: H in one tile


def test_splice_audio_count_zero_one_and_exactly_128(sim):
    embeds, audio, positions = splice_case(50, 24, 0, 0, torch.float32, seed=2)
    assert torch.equal(check_splice(sim, embeds, audio, positions), embeds)
    check_splice(sim, *splice_case(50, 24, 1, 1, torch.float32, seed=3))
    check_splice(sim, *splice_case(200, 24, 128, 0, torch.float32, seed=4))


def test_splice_voxtral_shape_one_chunk():
    # 375 audio rows of H = 3072 into a 391 + 1 row prompt: the instruction count of the tile plan
    embeds, audio, positions = splice_case(392, 3072, 375, 0, torch.bfloat16, seed=5)
    run = nki_interp.simulate(splice_kernel)
    got = run(embeds, audio, positions)
    assert torch.equal(got, splice_torch(embeds, audio, positions))
    assert run.counts == {"dma_copy": 1 + 3 * (1 + 2)}
