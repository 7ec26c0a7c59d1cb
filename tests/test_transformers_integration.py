"""MoBA inside Hugging Face transformers: a tiny random Llama, no downloads."""

import inspect
import sys
import types

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
from flex_standin import flex_standin  # noqa: E402
from transformers import (  # noqa: E402
    AttentionInterface,
    DataCollatorWithFlattening,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
)

from flexmoba import moba_reference, use_flex_attention  # noqa: E402
from flexmoba.integrations import transformers as hf  # noqa: E402
from flexmoba.kv_cache import ChunkKeySums  # noqa: E402

CHUNK, TOP_K, S = 8, 2, 40  # 5 chunks, 2 attended: MoBA is active
TOL = dict(rtol=1e-5, atol=1e-5)

hf.register("moba-sdpa", chunk_size=CHUNK, top_k=TOP_K, backend="sdpa")
hf.register("moba-gather", chunk_size=CHUNK, top_k=TOP_K, backend="gather")
hf.register("moba-wide", chunk_size=16, top_k=4, backend="sdpa")  # 64 >= S: plain causal attention
hf.register("moba-dense-decode", chunk_size=CHUNK, top_k=TOP_K, backend="sdpa", dense_decode=True)


def reference_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """flexmoba's dense oracle, per layer (no padding)."""
    out = moba_reference(query, key, value, chunk_size=CHUNK, top_k=TOP_K, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("moba-reference", reference_attention)

# transformers 5 renamed forward's past_key_values to cache.


pytestmark = pytest.mark.usefixtures("one_thread")


CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


def tiny_llama(kv_heads=2, attn="moba-sdpa", seed=0):
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=kv_heads, vocab_size=128, max_position_embeddings=128)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation(attn)
    return model


def tokens(B=2, length=S, seed=1):
    return torch.randint(0, 128, (B, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logits(model, ids, attn=None, **kwargs):
    if attn is not None:
        model.set_attn_implementation(attn)
    return model(ids, **kwargs).logits


@torch.no_grad()
def cached_logits(model, ids, pieces, **kwargs):
    """Feed ``ids`` piece by piece through a DynamicCache; concatenate the logits."""
    cache, outs, t = DynamicCache(config=model.config), [], 0
    for n in pieces:
        outs.append(model(ids[:, t:t + n], use_cache=True, **{CACHE_ARG: cache}, **kwargs).logits)
        t += n
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
def test_moba_covering_the_sequence_equals_sdpa(kv_heads):
    model, ids = tiny_llama(kv_heads, "moba-wide"), tokens()
    torch.testing.assert_close(logits(model, ids), logits(model, ids, "sdpa"), **TOL)


@pytest.mark.parametrize("attn", ["moba-sdpa", "moba-gather"])
@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
def test_moba_equals_per_layer_reference(kv_heads, attn):
    model, ids = tiny_llama(kv_heads, attn), tokens()
    moba = logits(model, ids)
    torch.testing.assert_close(moba, logits(model, ids, "moba-reference"), **TOL)
    assert (moba - logits(model, ids, "sdpa")).abs().max() > 1e-3  # MoBA really is sparse here


@pytest.mark.parametrize("pieces", [[10] + [1] * 30, [3, 20, 1, 1, 15]], ids=["token", "chunked"])
@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
def test_cached_decoding_equals_parallel_forward(kv_heads, pieces):
    model, ids = tiny_llama(kv_heads), tokens()
    torch.testing.assert_close(cached_logits(model, ids, pieces), logits(model, ids), **TOL)


def test_chunk_means_are_rebuilt_once_then_updated_in_place(monkeypatch):
    rebuilds = []
    original = ChunkKeySums.from_keys.__func__
    monkeypatch.setattr(ChunkKeySums, "from_keys",
                        classmethod(lambda cls, *a, **k: rebuilds.append(1) or original(cls, *a, **k)))
    model, ids = tiny_llama(), tokens()
    cached_logits(model, ids, [10] + [1] * 30)
    assert len(rebuilds) == model.config.num_hidden_layers


@pytest.mark.parametrize("edit", ["crop", "reorder"])
def test_cropped_or_reordered_cache_stays_exact(edit):
    # Assisted decoding crops the cache, beam search reorders it; the side sums must notice.
    model, ids = tiny_llama(), tokens()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        for t in range(30):
            model(ids[:, t:t + 1], use_cache=True, **{CACHE_ARG: cache})
        if edit == "crop":
            cache.crop(-10)  # drop the last 10 tokens
            resume, ids = 20, ids.clone()
            ids[:, 20:] = tokens(seed=7)[:, 20:]
        else:
            cache.reorder_cache(torch.tensor([1, 0]))  # same length, other rows
            resume, ids = 30, ids.flip(0)
        out = torch.cat([model(ids[:, t:t + 1], use_cache=True, **{CACHE_ARG: cache}).logits
                         for t in range(resume, S)], dim=1)
    torch.testing.assert_close(out, logits(model, ids)[:, resume:], **TOL)


hf.register("moba-recompute", chunk_size=CHUNK, top_k=TOP_K, backend="sdpa", chunk_means="recompute")


@pytest.mark.parametrize("attn", [
    "moba-recompute",
    pytest.param("moba-sdpa", marks=pytest.mark.xfail(strict=True, reason="documented limit of the O(1) check")),
])
def test_reorder_that_keeps_the_last_token(attn):
    # Two beams ending on the same token: the first layer's last keys are equal, so only
    # re-pooling the means from the cache notices the swap.
    model, ids = tiny_llama(attn=attn), tokens()
    ids[1, 29] = ids[0, 29]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        for t in range(30):
            model(ids[:, t:t + 1], use_cache=True, **{CACHE_ARG: cache})
        cache.reorder_cache(torch.tensor([1, 0]))
        ids = ids.flip(0)
        out = torch.cat([model(ids[:, t:t + 1], use_cache=True, **{CACHE_ARG: cache}).logits
                         for t in range(30, S)], dim=1)
    torch.testing.assert_close(out, logits(model, ids)[:, 30:], **TOL)


@pytest.mark.parametrize("attn", ["moba-sdpa", "moba-layer-hybrid"])
def test_right_padding_never_attended(attn):
    model, ids = tiny_llama(attn=attn), tokens()
    mask = torch.ones_like(ids)
    mask[1, 27:] = 0
    padded = logits(model, ids, attention_mask=mask)
    torch.testing.assert_close(padded[0], logits(model, ids[:1])[0], **TOL)
    torch.testing.assert_close(padded[1, :27], logits(model, ids[1:, :27])[0], **TOL)


hf.register("moba-layer-hybrid", chunk_size=CHUNK, top_k=TOP_K, backend="sdpa", full_attention_last_n_layers=1)


@pytest.mark.parametrize("attn", ["moba-sdpa", "moba-dense-decode", "moba-layer-hybrid"])
def test_left_padded_generation_equals_unpadded_rows(attn):
    model, ids = tiny_llama(attn=attn), tokens()
    short = ids[1, :29]
    batch = torch.stack([ids[0, :33], F.pad(short, (4, 0))])  # 4 tokens of left padding
    mask = torch.ones_like(batch)
    mask[1, :4] = 0
    kwargs = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True,
                  pad_token_id=0)
    with torch.no_grad():
        together = model.generate(batch, attention_mask=mask, **kwargs)
        alone = [model.generate(row[None], attention_mask=torch.ones_like(row[None]), **kwargs)
                 for row in (ids[0, :33], short)]
    for b in range(2):
        assert together.sequences[b, -6:].tolist() == alone[b].sequences[0, -6:].tolist()
        for step in range(6):
            torch.testing.assert_close(together.logits[step][b], alone[b].logits[step][0], **TOL)


def hybrid_reference(prefill):
    """MoBA for the first ``prefill`` rows, full causal attention after: what dense_decode computes."""
    def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        moba = moba_reference(query, key, value, chunk_size=CHUNK, top_k=TOP_K, scale=scaling)
        full = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
        return torch.cat([moba[:, :, :prefill], full[:, :, prefill:]], dim=2).transpose(1, 2), None
    return attention


def test_dense_decode_is_moba_prefill_then_full_attention():
    AttentionInterface.register("hybrid-reference-12", hybrid_reference(12))
    model, ids = tiny_llama(attn="moba-dense-decode"), tokens()
    decoded = cached_logits(model, ids, [12] + [1] * 28)
    torch.testing.assert_close(decoded, logits(model, ids, "hybrid-reference-12"), **TOL)
    assert (decoded - logits(model, ids, "moba-sdpa")).abs().max() > 1e-3


def test_unsupported_transformers_version(monkeypatch):
    # The module the integration imports (pytest's importorskip may hand back another object).
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.47.1")
    with pytest.raises(ImportError, match=r"transformers>=4\.48.*4\.47\.1"):
        hf.register("too-old", chunk_size=CHUNK, top_k=TOP_K)


def test_bad_settings_name_the_problem():
    with pytest.raises(ValueError, match="full_attention_last_n_layers"):
        hf.register("bad", full_attention_last_n_layers=-1)
    with pytest.raises(ValueError, match="granularity"):
        hf.register("bad", chunk_size=CHUNK, top_k=TOP_K, granularity=3)
    with pytest.raises(ValueError, match="chunk_size"):
        hf.register("bad", chunk_size=0, top_k=TOP_K)
    with pytest.raises(TypeError, match="top_k"):
        hf.register("bad", chunk_size=CHUNK, top_k="3")
    with pytest.raises(ValueError, match="backend"):
        hf.register("bad", chunk_size=CHUNK, top_k=TOP_K, backend="flash")
    with pytest.raises(ValueError, match="chunk_means"):
        hf.register("bad", chunk_size=CHUNK, top_k=TOP_K, chunk_means="cached")
    with pytest.raises(TypeError, match="dense_decode"):
        hf.register("bad", chunk_size=CHUNK, top_k=TOP_K, dense_decode="yes")


def test_unsupported_attention_calls_name_the_problem():
    attend = hf.make_attention_function(chunk_size=CHUNK, top_k=TOP_K, backend="sdpa")
    q, kv = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8)
    causal = types.SimpleNamespace(is_causal=True)
    with pytest.raises(ValueError, match="not causal"):
        attend(types.SimpleNamespace(is_causal=False), q, kv, kv, None)
    with pytest.raises(ValueError, match="not causal"):
        attend(causal, q, kv, kv, None, is_causal=False)
    with pytest.raises(ValueError, match="dropout"):
        attend(causal, q, kv, kv, None, dropout=0.1)
    with pytest.raises(ValueError, match="sliding_window"):
        attend(causal, q, kv, kv, None, sliding_window=4)
    with pytest.raises(ValueError, match="padding inside a sequence"):
        attend(causal, q, kv, kv, torch.tensor([[1, 1, 0, 0, 1, 1]]))
    bidirectional = torch.ones(1, 1, 6, 6, dtype=torch.bool)
    with pytest.raises(ValueError, match="not causal plus padding"):
        attend(causal, q, kv, kv, bidirectional)
    with pytest.raises(ValueError, match="only 6 keys"):
        attend(causal, torch.randn(1, 4, 7, 8), kv, kv, None)


def test_cached_steps_decode_with_the_settings_backend():
    # The adapter decodes through the one dispatch, with its backend: a registered decode
    # kernel is what a cached step returns; a backend that does not decode is refused by name.
    from flexmoba import register_backend
    from flexmoba.backends import registry

    register_backend("hf-marker", registry.get_backend("sdpa"), decode=lambda step: torch.full_like(step.q, 7.0))
    try:
        q, kv = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 30, 8)  # one query after 29 cached keys
        module = types.SimpleNamespace(is_causal=True)
        out, _ = hf.make_attention_function(chunk_size=4, top_k=2, backend="hf-marker")(module, q, kv, kv, None)
        assert torch.equal(out, torch.full((1, 1, 4, 8), 7.0))
        with pytest.raises(ValueError, match="backend 'flex' does not decode"):
            hf.make_attention_function(chunk_size=4, top_k=2, backend="flex")(module, q, kv, kv, None)
    finally:
        registry._registered.pop("hf-marker")


def test_non_causal_model_is_refused():
    model = tiny_llama()
    for layer in model.model.layers:
        layer.self_attn.is_causal = False
    with pytest.raises(ValueError, match="LlamaAttention is not causal"):
        logits(model, tokens())


def test_4d_causal_padding_mask_is_read_back():
    # What transformers < 4.53 passes: an additive float mask, causal plus padding.
    attend = hf.make_attention_function(chunk_size=4, top_k=2, backend="sdpa")
    q, k, v = torch.randn(2, 4, 12, 8), torch.randn(2, 2, 12, 8), torch.randn(2, 2, 12, 8)
    real = torch.ones(2, 12, dtype=torch.bool)
    real[0, 9:] = False  # right padding
    real[1, :3] = False  # left padding
    allowed = torch.ones(12, 12).tril().bool()[None] & real[:, None, :]
    additive = torch.zeros(2, 1, 12, 12).masked_fill(~allowed[:, None], torch.finfo(torch.float32).min)
    module = types.SimpleNamespace(is_causal=True)
    from_4d, _ = attend(module, q, k, v, additive)
    from_2d, _ = attend(module, q, k, v, real.long())
    torch.testing.assert_close(from_4d[0, :9], from_2d[0, :9])
    torch.testing.assert_close(from_4d[1, 3:], from_2d[1, 3:])


def test_training_step_backpropagates_and_refuses_dropout():
    model, ids = tiny_llama(attn="moba-gather"), tokens()
    model.train()
    model(ids, labels=ids).loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    with pytest.raises(ValueError, match="dropout"):
        model(ids, labels=ids)


hf.register("flexmoba-from-config")  # no defaults: every setting from the model's config.moba


def configured_llama(attn="flexmoba-from-config", **moba):
    model = tiny_llama(attn=attn)
    model.config.moba = {"chunk_size": CHUNK, "top_k": TOP_K, "backend": "sdpa", **moba}
    return model


def layer_hybrid_reference(n_full):
    """MoBA in the first layers, full causal attention in the last ``n_full``, by ``module.layer_idx``."""
    def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        if module.layer_idx >= module.config.num_hidden_layers - n_full:
            out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
        else:
            out = moba_reference(query, key, value, chunk_size=CHUNK, top_k=TOP_K, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    return attention


AttentionInterface.register("layer-hybrid-reference-1", layer_hybrid_reference(1))


def test_settings_come_from_the_model_config_on_every_call():
    model, ids = configured_llama(), tokens()
    torch.testing.assert_close(logits(model, ids), logits(model, ids, "moba-reference"), **TOL)
    model.config.moba = {"chunk_size": 16, "top_k": 4}  # 64 >= S: plain causal attention
    torch.testing.assert_close(logits(model, ids, "flexmoba-from-config"), logits(model, ids, "sdpa"), **TOL)


def test_model_config_wins_over_register_defaults():
    model, ids = tiny_llama(attn="moba-sdpa"), tokens()
    model.config.moba = {"top_k": 5}  # 5 chunks of 8 >= S: plain causal attention
    torch.testing.assert_close(logits(model, ids), logits(model, ids, "sdpa"), **TOL)


def test_last_layers_full_is_the_layer_hybrid():
    model, ids = configured_llama(full_attention_last_n_layers=1), tokens()
    hybrid = logits(model, ids)
    torch.testing.assert_close(hybrid, logits(model, ids, "layer-hybrid-reference-1"), **TOL)
    assert (hybrid - logits(model, ids, "moba-reference")).abs().max() > 1e-3
    model.config.moba["full_attention_last_n_layers"] = 2
    torch.testing.assert_close(logits(model, ids, "flexmoba-from-config"), logits(model, ids, "sdpa"), **TOL)


@pytest.mark.parametrize("pieces", [[10] + [1] * 30, [3, 20, 1, 1, 15]], ids=["token", "chunked"])
def test_layer_hybrid_cached_decoding_equals_parallel_forward(pieces):
    model, ids = configured_llama(full_attention_last_n_layers=1), tokens()
    torch.testing.assert_close(cached_logits(model, ids, pieces), logits(model, ids), **TOL)


def test_save_pretrained_keeps_the_moba_settings(tmp_path):
    model, ids = configured_llama(full_attention_last_n_layers=1), tokens()
    model.save_pretrained(tmp_path)
    loaded = LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="flexmoba-from-config").eval()
    assert loaded.config.moba == model.config.moba
    torch.testing.assert_close(logits(loaded, ids), logits(model, ids), **TOL)


def test_missing_or_bad_model_settings_name_config_moba():
    model, ids = tiny_llama(attn="flexmoba-from-config"), tokens()
    with pytest.raises(ValueError, match=r"config\.moba = \{'chunk_size'"):
        logits(model, ids)
    model.config.moba = {"chunk_size": CHUNK, "top_k": TOP_K, "topk": 3}
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['topk'\] in config\.moba"):
        logits(model, ids)
    model.config.moba = {"chunk_size": CHUNK, "top_k": 0}
    with pytest.raises(ValueError, match=r"config\.moba: top_k"):
        logits(model, ids)


DOCUMENTS = (17, 23)  # not chunk multiples: chunks must restart at the second document


@pytest.mark.parametrize("n_full", [0, 1], ids=["moba", "hybrid"])
@pytest.mark.parametrize("use_cache", [False, True], ids=["packing-mask", "position-ids"])
def test_packed_sequences_equal_per_document_forwards(use_cache, n_full):
    # Without a cache transformers builds a block-diagonal mask from the position ids; with
    # one it does not, and the position ids alone say where documents start.
    model, ids = configured_llama(full_attention_last_n_layers=n_full), tokens(B=1)
    position_ids = torch.cat([torch.arange(n) for n in DOCUMENTS])[None]
    packed = logits(model, ids, position_ids=position_ids, use_cache=use_cache)
    alone = torch.cat([logits(model, part) for part in ids.split(DOCUMENTS, dim=1)], dim=1)
    torch.testing.assert_close(packed, alone, **TOL)


def test_packing_collator_training_loss_equals_per_document_losses():
    # DataCollatorWithFlattening: one row, position ids restarting per document, -100 at each start.
    model, ids = configured_llama(full_attention_last_n_layers=1), tokens(B=1)
    documents = [part[0].tolist() for part in ids.split(DOCUMENTS, dim=1)]
    batch = DataCollatorWithFlattening()([{"input_ids": doc} for doc in documents])
    with torch.no_grad():
        packed = model(**batch, use_cache=False).loss
        alone = [model(torch.tensor([doc]), labels=torch.tensor([doc])).loss * (len(doc) - 1) for doc in documents]
    torch.testing.assert_close(packed, sum(alone) / (sum(DOCUMENTS) - len(DOCUMENTS)), **TOL)


def test_packed_batch_of_rows_with_different_documents():
    model, ids = configured_llama(), tokens(B=2)
    position_ids = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in ((17, 23), (40,))])
    packed = logits(model, ids, position_ids=position_ids, use_cache=False)
    first_row = torch.cat([logits(model, part) for part in ids[:1].split(DOCUMENTS, dim=1)], dim=1)
    torch.testing.assert_close(packed[0], first_row[0], **TOL)
    torch.testing.assert_close(packed[1], logits(model, ids[1:])[0], **TOL)


def test_static_cache_is_refused():
    model, ids = tiny_llama(), tokens()
    with pytest.raises(ValueError, match="static or sliding-window cache"):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False,
                       pad_token_id=0, cache_implementation="static")


def count_calls(monkeypatch, name: str) -> list:
    """Replace ``hf.<name>`` by a wrapper appending to the returned list at every call."""
    calls, original = [], getattr(hf, name)
    monkeypatch.setattr(hf, name, lambda *args, **kwargs: calls.append(name) or original(*args, **kwargs))
    return calls


def test_the_chunk_layout_is_built_once_per_forward_not_per_layer(monkeypatch):
    """Three MoBA layers, left padding (documents: the layout reads its chunk count on the host): one
    layout per forward, as the GPT builds it; the output is the same as building it per layer."""
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=128)
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation("moba-sdpa")
    ids = tokens()
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with torch.no_grad(), monkeypatch.context() as each_layer:
        each_layer.setattr(hf, "forward_layout", lambda *args: None)  # every layer's gate builds its own
        per_layer = model(ids, attention_mask=mask).logits
    built = count_calls(monkeypatch, "chunk_layout")
    with torch.no_grad():
        once = model(ids, attention_mask=mask).logits
    assert len(built) == 1
    torch.testing.assert_close(once, per_layer, rtol=0, atol=0)


@pytest.mark.parametrize("attn", ["moba-sdpa", "moba-dense-decode"])
def test_the_mask_is_analysed_once_per_forward_not_per_layer(attn, monkeypatch):
    """Three layers, one reading of the padding: at prefill and at every decoding step."""
    prefill, cached = count_calls(monkeypatch, "prefill_document_ids"), count_calls(monkeypatch, "cached_key_padding")
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=128)
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation(attn)
    ids = tokens()
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :30], attention_mask=mask[:, :30], use_cache=True, **{CACHE_ARG: cache})
        assert (len(prefill), len(cached)) == (1, 0)
        for t in range(30, 34):
            model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], use_cache=True, **{CACHE_ARG: cache})
        assert (len(prefill), len(cached)) == (1, 4)


def test_packed_position_ids_are_analysed_once(monkeypatch):
    """Without a mask the position ids are read, once for all layers; the same unchanged tensor
    again is not read again, a new one is."""
    calls = count_calls(monkeypatch, "prefill_document_ids")
    model, ids = configured_llama(), tokens(B=1)
    packed = torch.cat([torch.arange(n) for n in DOCUMENTS])[None]
    for position_ids, analysed in ((packed, 1), (packed, 1), (packed.clone(), 2)):
        logits(model, ids, position_ids=position_ids, use_cache=True)
        assert len(calls) == analysed


def test_a_mask_edited_in_place_is_analysed_again():
    mask = torch.ones(2, 8, dtype=torch.long)
    assert hf.forward_document_ids(mask, None, 2, 8, mask.device) is None
    mask[0, 6:] = 0  # right padding, written into the same tensor
    documents = hf.forward_document_ids(mask, None, 2, 8, mask.device)
    assert documents is not None and documents[0].tolist() == [0] * 6 + [1] * 2


hf.register("moba-flex", chunk_size=CHUNK, top_k=TOP_K, backend="flex")


def loss_and_grads(model, ids):
    model.zero_grad()
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
def test_flex_backend_trains_like_gather_through_the_adapter(kv_heads):
    """The GPU path (the regrouped plan on flex's own LSE) via the differentiable stand-in."""
    model, ids = tiny_llama(kv_heads, "moba-gather"), tokens()
    want_loss, want = loss_and_grads(model, ids)
    model.set_attn_implementation("moba-flex")
    with use_flex_attention(flex_standin):
        got_loss, got = loss_and_grads(model, ids)
        moba = logits(model, ids)
    torch.testing.assert_close(moba, logits(model, ids, "moba-reference"), **TOL)
    torch.testing.assert_close(got_loss, want_loss, **TOL)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")


LOAD_BEFORE_REGISTER = """
import sys
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

folder = sys.argv[1]
config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=128, max_position_embeddings=128)
config.moba = {"chunk_size": 8, "top_k": 2, "backend": "sdpa"}
LlamaForCausalLM(config).save_pretrained(folder)
try:  # transformers' own check, before any flexmoba code runs: its generic list (documented in the module)
    AutoModelForCausalLM.from_pretrained(folder, attn_implementation="flexmoba")
except ValueError as error:
    print("transformers:", str(error).splitlines()[0])
from flexmoba.integrations import transformers as hf

print("registered before:", hf.is_registered())
model = hf.from_pretrained(folder).eval()  # our entry point registers "flexmoba" first
print("loaded:", model.config._attn_implementation, hf.is_registered())
print("finite:", bool(torch.isfinite(model(torch.arange(40)[None]).logits).all()))
try:
    hf.from_config(config, attn_implementation="moba-wide")
except ValueError as error:
    print("ours:", error)
"""


def test_loading_before_register_is_the_entry_points_job_and_says_to_register(tmp_path):
    import subprocess

    proc = subprocess.run([sys.executable, "-c", LOAD_BEFORE_REGISTER, str(tmp_path / "llama")], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith('transformers: Specified `attn_implementation="flexmoba"` is not supported'), lines
    assert lines[1:4] == ["registered before: False", "loaded: flexmoba True", "finite: True"], lines
    assert lines[4] == ("ours: flexmoba: attn_implementation='moba-wide' is not registered with transformers; call "
                        "flexmoba.integrations.transformers.register('moba-wide', ...) before loading the model"), lines
