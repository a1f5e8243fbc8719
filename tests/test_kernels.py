"""kernels/verify_ref.py: the verify-kernel contract against a plain Python loop of the same rule."""
import pytest
import torch

from nxdi_voxtral.kernels.verify_ref import greedy_verify_ref


def loop_reference(candidates, logits, n_valid):
    target = [int(torch.argmax(row)) for row in logits]
    a = 0
    while a < n_valid and candidates[a + 1] == target[a]:
        a += 1
    return target, a, target[a]


@pytest.mark.parametrize("seed", range(20))
def test_greedy_verify_ref_matches_loop(seed):
    g = torch.Generator().manual_seed(seed)
    k, v = int(torch.randint(1, 16, (1,), generator=g)), 50
    logits = torch.randint(0, 4, (1, k + 1, v), generator=g).float()  # small integers: many ties
    target = torch.argmax(logits, -1)[0]
    cand = torch.cat([torch.tensor([7]), target[:-1]])
    cut = int(torch.randint(0, k + 1, (1,), generator=g))
    if cut < k:
        cand[cut + 1] = (cand[cut + 1] + 1) % v  # first mismatch at proposal `cut`
    n_valid = int(torch.randint(0, k + 1, (1,), generator=g))
    t, a, b = greedy_verify_ref(cand[None].int(), logits, torch.tensor([n_valid], dtype=torch.int32))
    rt, ra, rb = loop_reference(cand.tolist(), logits[0], n_valid)
    assert t[0].tolist() == rt and int(a[0]) == ra == min(cut, n_valid) and int(b[0]) == rb
    assert t.dtype == a.dtype == b.dtype == torch.int32
