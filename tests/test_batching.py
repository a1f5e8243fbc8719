"""Batch invariance, bitwise: every sequence of a batch gets exactly its batch-1 greedy tokens, whatever its
batch-mates, its KV slot, the batch bucket, the step it joined at, where it stops (EOS or max_new_tokens, also
inside an accepted block) and whether speculation is on; for every draft kind, in fp32 and bf16, and at tp 2.

The needle harness drives the batch loop (generate.Batch) directly: random compositions of prompts, random join
steps, random free slots, per-sequence max_new_tokens and EOS ids drawn from the reference so that sequences stop
at different steps, inside accepted blocks."""
import random
from dataclasses import dataclass, replace

import pytest
import torch

from conftest import SMALL_BUCKETS, noise
from nxdi_voxtral import NxDVoxtralSpecDec
from nxdi_voxtral import generate as gen
from nxdi_voxtral.errors import ConfigError
from nxdi_voxtral.graphs import batch_sizes_up_to, graph_plan, parse_buckets

BATCH_BUCKETS = replace(SMALL_BUCKETS, batch_sizes=(1, 2, 4))
LONGEST = 40  # reference tokens per prompt
SECONDS = (1, 2, 3, 5, 8, 35)  # 35 s: two audio chunks


@dataclass
class Request:
    prompt: int
    join: int         # the step at which it may join
    max_new: int
    eos: int | None   # an id of its reference (the model's own EOS when None)


def expected(ref: list[int], r: Request, model_eos: int) -> list[int]:
    eos = model_eos if r.eos is None else r.eos
    cut = ref.index(eos) + 1 if eos in ref[:r.max_new] else r.max_new
    return ref[:cut]


def random_requests(rng: random.Random, refs: list[list[int]], n: int) -> list[Request]:
    out = []
    for _ in range(n):
        p = rng.randrange(len(refs))
        max_new = rng.randint(1, LONGEST)
        eos = refs[p][rng.randrange(max_new)] if rng.random() < 0.5 else None
        out.append(Request(p, rng.randrange(12), max_new, eos))
    return out


def run_mix(m: NxDVoxtralSpecDec, prompts, requests: list[Request], rng: random.Random) -> list[list[int]]:
    """The requests through one Batch: each joins at its step (or when a slot frees), into a random free slot."""
    batch, waiting, done, step = gen.Batch(m.buckets), sorted(enumerate(requests), key=lambda x: x[1].join), {}, 0
    while waiting or batch.active:
        while waiting and waiting[0][1].join <= step and batch.free:
            i, r = waiting.pop(0)
            slot = batch.free.pop(rng.randrange(len(batch.free)))
            p = prompts[r.prompt]
            seq = m.start(p.input_ids, p.input_features, r.max_new, slot, i)
            if r.eos is not None:
                seq.eos_id = r.eos  # a per-sequence EOS: stops land anywhere, also inside accepted blocks
            batch.active.append(seq)
            if seq.done:
                batch.release(seq)
                done[i] = seq.tokens
        if batch.active:
            for seq in batch.step(m.run, m.drafter, m.setup.k):
                done[seq.index] = seq.tokens
        step += 1
    return [done[i] for i in range(len(requests))]


@pytest.fixture(scope="module")
def prompts(spec_models):
    m = spec_models["plain"]
    return [m.prepare(noise(s, seed=i), sampling_rate=16000) for i, s in enumerate(SECONDS)]


def batch_model(spec_dirs, kind: str, dtype, tp: int = 1) -> NxDVoxtralSpecDec:
    d = spec_dirs
    kw = {"plain": {}, "layers": dict(draft=d["layers_high"], draft_kind="layers", num_speculative_tokens=4),
          "dflash": dict(draft=d["dflash"], draft_kind="dflash"),
          "ngram": dict(draft_kind="ngram", num_speculative_tokens=3)}[kind]
    return NxDVoxtralSpecDec.from_pretrained(d["target"], dtype=dtype, buckets=BATCH_BUCKETS, tp_degree=tp, **kw)


def references(m: NxDVoxtralSpecDec, prompts) -> list[list[int]]:
    return [m.generate(p.input_ids, p.input_features, LONGEST)[0].tolist() for p in prompts]


@pytest.fixture(scope="module")
def refs(spec_dirs, spec_models, prompts):
    """Plain greedy, one sequence at a time, on batch-1 models (one KV slot)."""
    bf16 = NxDVoxtralSpecDec.from_pretrained(spec_dirs["target"], dtype=torch.bfloat16, buckets=SMALL_BUCKETS)
    return {torch.float32: references(spec_models["plain"], prompts), torch.bfloat16: references(bf16, prompts)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["plain", "layers", "dflash", "ngram"])
def test_needles_every_sequence_equals_its_batch1_run(spec_dirs, prompts, refs, kind, dtype):
    m = batch_model(spec_dirs, kind, dtype)
    ref, eos = refs[dtype], m.cfg.text.eos_token_id
    for seed in range(6):
        rng = random.Random(1000 * seed + len(kind))
        requests = random_requests(rng, ref, rng.randint(2, 9))
        got = run_mix(m, prompts, requests, rng)
        for r, tokens in zip(requests, got):
            assert tokens == expected(ref[r.prompt], r, eos), (kind, seed, r)


def test_batch_api_lists_in_order_equal_single_calls(spec_dirs, spec_models, prompts, refs):
    """generate / transcribe with lists: results in input order, each the single call's; more prompts than slots
    join as slots free up."""
    m = batch_model(spec_dirs, "layers", torch.float32)
    order = [5, 0, 3, 3, 1, 4, 2]  # 7 prompts on 4 slots, one repeated
    ids, stats = zip(*m.generate([prompts[i].input_ids for i in order], [prompts[i].input_features for i in order],
                                 LONGEST, return_stats=True))
    assert [x[0].tolist() for x in ids] == [refs[torch.float32][i] for i in order]
    assert all(s.verify_calls > 0 and s.generated == LONGEST for s in stats)
    single = m.generate(prompts[2].input_ids, prompts[2].input_features, 7)
    assert single.shape == (1, 7) and single[0].tolist() == refs[torch.float32][2][:7]
    streamed: dict = {}
    m.generate([prompts[0].input_ids, prompts[1].input_ids], [prompts[0].input_features, prompts[1].input_features],
               9, on_tokens=lambda i, new: streamed.setdefault(i, []).extend(new))
    assert streamed == {0: refs[torch.float32][0][:9], 1: refs[torch.float32][1][:9]}
    clips = [noise(s, seed=i) for i, s in enumerate(SECONDS[:3])]
    texts = m.transcribe(clips, sampling_rate=16000, max_new_tokens=12)
    assert [t.text for t in texts] == [spec_models["plain"].transcribe(c, sampling_rate=16000, max_new_tokens=12).text
                                       for c in clips]


@pytest.mark.parametrize("kind", ["plain", "dflash"])
def test_needles_tp2(spec_dirs, prompts, kind):
    """tp 2: the reference is the same model one sequence at a time (tp 2 is bitwise its own, not tp 1's)."""
    plain = batch_model(spec_dirs, "plain", torch.float32, tp=2)
    try:
        ref = references(plain, prompts)
        m = plain if kind == "plain" else batch_model(spec_dirs, kind, torch.float32, tp=2)
        try:
            for seed in range(3):
                rng = random.Random(seed)
                requests = random_requests(rng, ref, 6)
                for r, tokens in zip(requests, run_mix(m, prompts, requests, rng)):
                    assert tokens == expected(ref[r.prompt], r, m.cfg.text.eos_token_id), (seed, r)
        finally:
            if m is not plain:
                m.close()
    finally:
        plain.close()


def test_batch_buckets_in_the_plan_and_the_cli():
    assert parse_buckets("audio=1:kv=512:batch=1,2,8").batch_sizes == (1, 2, 8)
    assert batch_sizes_up_to(8) == (1, 2, 4, 8) and batch_sizes_up_to(6) == (1, 2, 4, 6)
    with pytest.raises(ConfigError, match="increasing"):
        parse_buckets("batch=4,2")
    with pytest.raises(ConfigError, match="max_batch_size"):
        batch_sizes_up_to(0)


def test_every_decode_side_graph_per_batch_bucket(spec_models, spec_dirs):
    m = batch_model(spec_dirs, "dflash", torch.float32)
    plan = {(s.tag, s.batch) for s in graph_plan(m.setup)}
    for tag in ("token_generation", "verify", "dflash_draft"):
        assert {b for t, b in plan if t == tag} == {1, 2, 4}
    for tag in ("audio_encoder", "context_encoding", "dflash_context"):
        assert {b for t, b in plan if t == tag} == {1}
    with pytest.raises(ConfigError, match="row-invariant"):
        NxDVoxtralSpecDec.from_pretrained(spec_dirs["target"], draft=spec_dirs["dflash"], draft_kind="dflash",
                                          buckets=replace(SMALL_BUCKETS, batch_sizes=(1, 64)))
