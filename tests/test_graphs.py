"""The graph contract (docs/design.md §2) on every (tag, bucket)."""
import dataclasses

import pytest
import torch

from nxdi_voxtral.contract import (ContractViolation, check_distinct_signatures, check_graph_call, signature)
from nxdi_voxtral.graphs import Buckets, build_graph, example_inputs, graph_plan

from conftest import SMALL_BUCKETS, noise


KINDS = ["plain", "layers", "dflash", "ngram"]


def cases():
    from conftest import SMALL_BUCKETS as B
    from nxdi_voxtral.graphs import GraphSetup
    from conftest import make_cfg
    # the tag/bucket list only depends on the draft kind; the setup used for calls is the model's own
    plans = {"plain": GraphSetup(make_cfg(), B), "layers": GraphSetup(make_cfg(), B, draft_kind="layers", k=4),
             "dflash": GraphSetup(make_cfg(), B, draft_kind="dflash", k=15, capture_layers=(0,), dflash_block=16),
             "ngram": GraphSetup(make_cfg(), B, draft_kind="ngram", k=3)}
    return [(kind, s.tag, s.bucket) for kind in KINDS for s in graph_plan(plans[kind])
            if kind == "plain" or s.tag not in ("audio_encoder", "context_encoding", "token_generation")]


@pytest.mark.parametrize("kind,tag,bucket", cases())
def test_every_graph_runs_at_its_bucket_within_contract(spec_models, kind, tag, bucket):
    m = spec_models[kind]
    spec = next(s for s in graph_plan(m.setup) if (s.tag, s.bucket) == (tag, bucket))
    graph = build_graph(spec, m.setup, m.model, m.draft)
    inputs = example_inputs(spec, m.setup)
    out1 = check_graph_call(f"{tag}[{bucket}]", graph, inputs)
    # same shapes out for different values in: shapes do not depend on data
    varied = tuple(torch.randint_like(t, 0, 7) if not t.is_floating_point() else torch.randn_like(t) for t in inputs)
    if tag in ("context_encoding", "draft_context_encoding"):  # audio positions may only point at the scratch row
        varied = varied[:2] + (inputs[2],) + varied[3:]
    if tag != "audio_encoder":  # the slots must name KV slots the model has
        varied = varied[:-1] + (inputs[-1],)
    out2 = check_graph_call(f"{tag}[{bucket}]", graph, varied)
    assert [o.shape for o in out1] == [o.shape for o in out2]
    assert all(o.dtype in (torch.int32, torch.float32) for o in out1)


def test_signatures_are_distinct_for_every_draft_kind(spec_models):
    for m in spec_models.values():
        for b in (SMALL_BUCKETS, Buckets()):
            setup = dataclasses.replace(m.setup, buckets=b)
            check_distinct_signatures({(s.tag, s.bucket): signature(example_inputs(s, setup))
                                       for s in graph_plan(setup)})
    k1 = dataclasses.replace(spec_models["layers"].setup, k=1)  # verify [1,2] vs draft_fused_k [1,2]
    check_distinct_signatures({(s.tag, s.bucket): signature(example_inputs(s, k1)) for s in graph_plan(k1)})
    with pytest.raises(ContractViolation, match="same input shapes"):
        check_distinct_signatures({("a", 1): ((1, 2),), ("b", 2): ((1, 2),)})


def test_checker_catches_banned_ops_bool_indexing_and_int64():
    class Sorts(torch.nn.Module):
        def forward(self, x):
            return (torch.sort(x).values,)

    class MaskScatter(torch.nn.Module):
        def forward(self, x):
            return (x.masked_scatter(x > 0, torch.zeros_like(x)),)

    class BoolIndex(torch.nn.Module):
        def forward(self, x):
            return (x[x > 0].sum().reshape(1),)

    class HostSync(torch.nn.Module):
        def forward(self, x):
            return (x * float(x.sum().item()),)

    x = torch.randn(8)
    with pytest.raises(ContractViolation, match="sort"):
        check_graph_call("g", Sorts(), (x,))
    with pytest.raises(ContractViolation, match="masked_scatter"):
        check_graph_call("g", MaskScatter(), (x,))
    with pytest.raises(ContractViolation, match="nonzero|boolean"):
        check_graph_call("g", BoolIndex(), (x,))
    with pytest.raises(ContractViolation, match="item|_local_scalar_dense"):
        check_graph_call("g", HostSync(), (x,))
    with pytest.raises(ContractViolation, match="int64"):
        check_graph_call("g", torch.nn.Identity(), (torch.zeros(2, dtype=torch.long),))


def test_runtime_only_calls_declared_shapes_and_all_buckets_reachable(tiny_model):
    calls = []
    orig = tiny_model.run

    def spy(tag, bucket, *inputs):
        calls.append((tag, bucket))
        return orig(tag, bucket, *inputs)  # run() itself rejects undeclared shapes
    tiny_model.run = spy
    try:
        for seconds in (2.0, 45.0):
            p = tiny_model.prepare(noise(seconds), sampling_rate=16000)
            tiny_model.generate(p.input_ids, p.input_features, max_new_tokens=260 if seconds > 30 else 4)
    finally:
        del tiny_model.run
    assert {("audio_encoder", 1), ("audio_encoder", 2), ("context_encoding", 2), ("token_generation", 1024)} <= \
        set(calls)
    with pytest.raises(ContractViolation, match="called with shapes"):
        tiny_model.run("token_generation", 512, torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                       torch.zeros(1, 512, dtype=torch.int32))


def test_kv_cache_written_in_place_and_rejected_slots_unread(tiny_model):
    """A token's output only depends on cache slots before it: garbage past the valid length changes nothing."""
    m = tiny_model
    p = m.prepare(noise(2.0, seed=5), sampling_rate=16000)
    ids = m.generate(p.input_ids, p.input_features, max_new_tokens=6)[0].tolist()
    cache_ptr = m.model.language_model.k_cache.data_ptr()
    pos = p.input_ids.shape[1] + 5
    m.model.language_model.k_cache[:, :, :, pos:] = 1e4  # pretend rejected speculation left junk here
    m.model.language_model.v_cache[:, :, :, pos:] = -1e4
    again = m.generate(p.input_ids, p.input_features, max_new_tokens=6)[0].tolist()
    assert again == ids
    assert m.model.language_model.k_cache.data_ptr() == cache_ptr
