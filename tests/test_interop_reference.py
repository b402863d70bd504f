"""jspec's imported EAGLE-3 / DFlash drafters against reference forwards written in PyTorch.

The references follow the public reference code's structure, not jspec's: EAGLE-3 as
SpecForge's `LlamaForCausalLMEagle3` (embed_tokens / midlayer with hidden_norm +
input_layernorm on the fused input / fc / norm / lm_head / d2t, t2d), driven the way vLLM's
EagleProposer drafts (entries (h_s, token s+1) at position s, chained on the pre-norm output);
DFlash as z-lab's `DFlashDraftModel` (fc + hidden_norm context, q/k norm, context K/V
concatenated before the block's, no mask, the target's embedding and LM head). The target's
hidden states come from HF transformers on the same weights (`output_hidden_states`), so the
feature-layer conventions are checked against HF's own indexing too. Random checkpoints are
written from the reference modules' state_dicts: their tensor names are the layout.

Needs the `peer` extra (torch); skipped without it.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402
from torch import nn  # noqa: E402

import jspec  # noqa: E402
from jspec.drafters.base import DraftContext  # noqa: E402
from jspec.models import ModelConfig, init_weights  # noqa: E402
from jspec.models.loading import weights_to_hf, write_hf_dir  # noqa: E402
from jspec.models.model import Model  # noqa: E402
from jspec.rounds import init_state, speculative_round  # noqa: E402
from jspec.sampling import dense_q  # noqa: E402
from jspec.verify import Lossless  # noqa: E402

ATOL = 1e-4
TARGETS = {  # 4 layers: room for three distinct feature layers below the last
    # Llama 3.x-like: llama3 RoPE scaling, theta 5e5, untied head; Qwen3: q/k norms.
    "llama": ModelConfig(arch="llama", vocab_size=97, hidden_size=32, num_layers=4, num_heads=4,
                         num_kv_heads=2, head_dim=8, ffn_size=48, rope_theta=5e5,
                         rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0),
                                       ("low_freq_factor", 1.0),
                                       ("original_max_position_embeddings", 64),
                                       ("rope_type", "llama3")),
                         tie_embeddings=False, rms_eps=1e-5),
    "qwen3": ModelConfig(arch="qwen3", vocab_size=97, hidden_size=32, num_layers=4, num_heads=4,
                         num_kv_heads=2, head_dim=16, ffn_size=48, qk_norm=True,
                         tie_embeddings=False, rope_theta=1e6, rms_eps=1e-6),
}


def random_model(arch: str) -> Model:
    cfg = TARGETS[arch]
    abstract = jax.eval_shape(functools.partial(init_weights, cfg, scale=0.2), jax.random.key(0))
    rng = np.random.default_rng(11)

    def fill(path, a):
        key = jax.tree_util.keystr(path)
        x = (1.0 + 0.1 * rng.standard_normal(a.shape) if "norm" in key
             else (1.0 if key == ".embed" else 0.25) * rng.standard_normal(a.shape))
        return jnp.asarray(x, a.dtype)

    return Model(config=cfg, weights=jax.tree_util.tree_map_with_path(fill, abstract), name=arch)


@functools.cache
def targets(arch: str, tmp: str) -> tuple[Model, Any]:
    """The same random target as an HF safetensors directory, loaded by jspec
    (`load_model(DIR)`) and by HF transformers."""
    m = random_model(arch)
    write_hf_dir(tmp, m.config, weights_to_hf(m.config, m.weights))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    return jspec.load_model(tmp), hf


def hidden_states(hf, tokens: np.ndarray) -> tuple:
    """HF's `hidden_states`: [0] the embeddings, [i] the input of decoder layer i."""
    with torch.no_grad():
        return hf(torch.tensor(np.array(tokens[None]), dtype=torch.long),
                  output_hidden_states=True).hidden_states


# ----------------------------------------------------------------------------- shared pieces
class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))


class MLP(nn.Module):
    def __init__(self, d: int, f: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def cos_sin(positions, head_dim: int, theta: float):
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    ang = positions.double()[:, None] * inv[None]
    emb = torch.cat((ang, ang), dim=-1)
    return emb.cos().float(), emb.sin().float()  # [T, hd]


def sdpa(q, k, v, mask=None):
    """q [B, H, Q, hd], k/v [B, KV, S, hd] (repeated to H heads), mask bool [Q, S] or None."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s.float(), dim=-1) @ v


def randomise(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def vocab_map(v: int, vd: int, seed: int):
    used = torch.sort(torch.randperm(v, generator=torch.Generator().manual_seed(seed))[:vd]).values
    return used - torch.arange(vd), torch.isin(torch.arange(v), used)


# ----------------------------------------------------------------------------- EAGLE-3 reference
class Eagle3Attention(nn.Module):
    def __init__(self, d: int, h: int, kv: int, hd: int, theta: float):
        super().__init__()
        self.h, self.kv, self.hd, self.theta = h, kv, hd, theta
        self.q_proj = nn.Linear(2 * d, h * hd, bias=False)
        self.k_proj = nn.Linear(2 * d, kv * hd, bias=False)
        self.v_proj = nn.Linear(2 * d, kv * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, d, bias=False)

    def forward(self, x, positions, past):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.h, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv, self.hd).transpose(1, 2)
        cos, sin = cos_sin(positions, self.hd, self.theta)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        s = k.shape[2]
        mask = torch.arange(s)[None, :] <= (s - t + torch.arange(t))[:, None]  # causal
        o = sdpa(q, k, v, mask).transpose(1, 2).reshape(b, t, self.h * self.hd)
        return self.o_proj(o), (k, v)


class Eagle3DecoderLayer(nn.Module):
    """SpecForge's midlayer: [input_layernorm(emb), hidden_norm(h)] into attention."""

    def __init__(self, d, h, kv, hd, f, eps, theta, norm_before_residual):
        super().__init__()
        self.self_attn = Eagle3Attention(d, h, kv, hd, theta)
        self.mlp = MLP(d, f)
        self.hidden_norm = RMSNorm(d, eps)
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.norm_before_residual = norm_before_residual

    def forward(self, input_emb, hidden, positions, past):
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden  # vLLM's option
        x = torch.cat((self.input_layernorm(input_emb), normed), dim=-1)
        a, past = self.self_attn(x, positions, past)
        hidden = residual + a
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return hidden, past


class Eagle3Draft(nn.Module):
    """SpecForge's LlamaForCausalLMEagle3 layout (the state_dict names are the checkpoint's)."""

    def __init__(self, v, vd, d, h, kv, hd, f, eps, theta, nbr=False):
        super().__init__()
        self.embed_tokens = nn.Embedding(v, d)
        self.midlayer = Eagle3DecoderLayer(d, h, kv, hd, f, eps, theta, nbr)
        self.fc = nn.Linear(3 * d, d, bias=False)
        self.norm = RMSNorm(d, eps)
        self.lm_head = nn.Linear(d, vd, bias=False)
        self.register_buffer("d2t", torch.zeros(vd, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(v, dtype=torch.bool))

    def draft(self, hs, layer_ids, tokens, k, chain, embed):
        """vLLM-style drafting after a prefill of `tokens` (prompt + the sampled next token).

        hs: HF hidden_states over tokens[:-1]; chain: the tokens to feed the chain (None:
        its own argmax); embed: the embedding to use. Returns (draft ids [k] in the target
        vocabulary, log-softmax over the draft vocabulary [k, Vd])."""
        s = len(tokens) - 1
        g = self.fc(torch.cat([hs[i][:, :s] for i in layer_ids], dim=-1))
        nxt = torch.tensor(np.array(tokens[1:]), dtype=torch.long)[None]
        h, past = self.midlayer(embed(nxt), g, torch.arange(s), None)
        h, pos, drafts, logps = h[:, -1:], s - 1, [], []
        for j in range(k):
            logits = self.lm_head(self.norm(h))[0, 0]
            logps.append(torch.log_softmax(logits, -1))
            tok = int(torch.argmax(logits)) + int(self.d2t[int(torch.argmax(logits))])
            drafts.append(tok)
            if j + 1 < k:
                pos += 1
                t = tok if chain is None else int(chain[j])
                h, past = self.midlayer(embed(torch.tensor([[t]])), h, torch.tensor([pos]), past)
        return drafts, torch.stack(logps)


def write_eagle3(path, model: Model, *, own_embed: bool, layer_field: str, nbr: bool, seed=0):
    c = model.config
    vd = 40
    ref = Eagle3Draft(c.vocab_size, vd, c.hidden_size, 4, 2, 8, 40, 1e-6, 5e4, nbr)
    randomise(ref, seed)
    d2t, t2d = vocab_map(c.vocab_size, vd, seed)
    ref.d2t.copy_(d2t)
    ref.t2d.copy_(t2d)
    sd = {k: v.contiguous() for k, v in ref.state_dict().items()}
    if not own_embed:
        sd.pop("embed_tokens.weight")
    path.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    n = c.num_layers
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
           "hidden_size": c.hidden_size, "intermediate_size": 40, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 8, "num_hidden_layers": 1,
           "rms_norm_eps": 1e-6, "rope_theta": 5e4, "vocab_size": c.vocab_size,
           "draft_vocab_size": vd, "hidden_act": "silu", "tie_word_embeddings": False,
           "torch_dtype": "float32", "norm_before_residual": nbr}
    if layer_field == "vllm":  # capture indices: HF hidden_states[i]
        cfg["eagle_aux_hidden_state_layer_ids"], hf_ids = [1, 2, 3], [1, 2, 3]
    elif layer_field == "sglang":  # 0-indexed layer outputs: HF hidden_states[j + 1]
        cfg["eagle_config"], hf_ids = {"eagle_aux_hidden_state_layer_ids": [0, 2, 1]}, [1, 3, 2]
    else:  # the engines' default
        hf_ids = [2, n // 2, n - 3]
    (path / "config.json").write_text(json.dumps(cfg))
    return ref, hf_ids


# ----------------------------------------------------------------------------- DFlash reference
class DFlashAttention(nn.Module):
    def __init__(self, d, h, kv, hd, eps, theta):
        super().__init__()
        self.h, self.kv, self.hd, self.theta = h, kv, hd, theta
        self.q_proj = nn.Linear(d, h * hd, bias=False)
        self.k_proj = nn.Linear(d, kv * hd, bias=False)
        self.v_proj = nn.Linear(d, kv * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, eps)
        self.k_norm = RMSNorm(hd, eps)

    def forward(self, hidden, target_hidden, positions):
        b, q_len, _ = hidden.shape
        ctx = target_hidden.shape[1]
        q = self.q_norm(self.q_proj(hidden).view(b, q_len, self.h, self.hd)).transpose(1, 2)
        k = torch.cat([self.k_proj(target_hidden), self.k_proj(hidden)], dim=1)
        v = torch.cat([self.v_proj(target_hidden), self.v_proj(hidden)], dim=1)
        k = self.k_norm(k.view(b, ctx + q_len, self.kv, self.hd)).transpose(1, 2)
        v = v.view(b, ctx + q_len, self.kv, self.hd).transpose(1, 2)
        cos, sin = cos_sin(positions, self.hd, self.theta)  # context then block positions
        q = q * cos[-q_len:] + rotate_half(q) * sin[-q_len:]
        k = k * cos + rotate_half(k) * sin
        o = sdpa(q, k, v).transpose(1, 2).reshape(b, q_len, self.h * self.hd)  # no mask
        return self.o_proj(o)


class DFlashLayer(nn.Module):
    def __init__(self, d, h, kv, hd, f, eps, theta):
        super().__init__()
        self.self_attn = DFlashAttention(d, h, kv, hd, eps, theta)
        self.mlp = MLP(d, f)
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)

    def forward(self, target_hidden, hidden, positions):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), target_hidden, positions)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DFlashDraft(nn.Module):
    """z-lab's DFlashDraftModel layout."""

    def __init__(self, n_layers, n_feat, d, h, kv, hd, f, eps, theta):
        super().__init__()
        self.layers = nn.ModuleList([DFlashLayer(d, h, kv, hd, f, eps, theta)
                                     for _ in range(n_layers)])
        self.norm = RMSNorm(d, eps)
        self.fc = nn.Linear(n_feat * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, eps)

    def forward(self, target_hidden, noise_embedding, positions):
        th = self.hidden_norm(self.fc(target_hidden))
        h = noise_embedding
        for layer in self.layers:
            h = layer(th, h, positions)
        return self.norm(h)

    def draft(self, hf, hs, layer_ids, tokens, k, mask_id):
        """One block [last, MASK x k] after the committed tokens (tokens[-1] = last)."""
        c = len(tokens) - 1
        ctx = torch.cat([hs[i + 1][:, :c] for i in layer_ids], dim=-1)  # extract_context_feature
        block = torch.as_tensor([tokens[-1]] + [mask_id] * k, dtype=torch.long)[None]
        out = self(ctx, hf.model.embed_tokens(block), torch.arange(c + k + 1))
        logits = hf.lm_head(out[:, 1:])[0]
        return [int(t) for t in torch.argmax(logits, -1)], torch.log_softmax(logits, -1)


def write_dflash(path, model: Model, block: int, seed=0):
    c = model.config
    ids = [0, 2]  # target_layer_ids: HF hidden_states[1], [3]
    ref = DFlashDraft(2, len(ids), c.hidden_size, 4, 2, 8, 40, 1e-6, 1e6)
    randomise(ref, seed)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()},
              str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": block,
           "hidden_size": c.hidden_size, "intermediate_size": 40, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 8, "num_hidden_layers": 2,
           "num_target_layers": c.num_layers, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
           "vocab_size": c.vocab_size, "hidden_act": "silu", "attention_bias": False,
           "layer_types": ["full_attention"] * 2, "tie_word_embeddings": False,
           "dflash_config": {"mask_token_id": c.vocab_size - 1, "target_layer_ids": ids}}
    (path / "config.json").write_text(json.dumps(cfg))
    return ref, ids


# ----------------------------------------------------------------------------- jspec side
PROMPTS = [[5, 17, 33, 5, 17, 33, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]


def jspec_rounds(model, drafter, k, rounds, temperature, seed=0):
    """(committed tokens, drafts, q) per row at each of `rounds` + 1 proposals: the state after
    prefill, then after each greedy speculative round."""
    ids = np.zeros((2, 16), np.int32)
    for i, p in enumerate(PROMPTS):
        ids[i, :len(p)] = p
    lens = np.asarray([len(p) for p in PROMPTS], np.int32)
    st = init_state(model.config, model.weights, drafter, jnp.asarray(ids), jnp.asarray(lens),
                    jax.random.key(seed), sampling=jspec.Sampling(), max_new_tokens=40,
                    capacity=128, eos_ids=(), k=k, verifier=Lossless())
    rnd = jax.jit(functools.partial(speculative_round, model.config, model.weights, drafter,
                                    policy=jspec.FixedLength(k), sampling=jspec.Sampling(), eos_ids=(),
                                    verifier=Lossless()))
    sampling = jspec.Sampling(temperature=temperature)
    out = []
    for r in range(rounds + 1):
        ctx = DraftContext(seq=st.seq, cache_len=st.cache.lengths, last=st.last)
        toks, q, _ = drafter.propose(st.drafter, ctx, k, sampling, jax.random.key(100 + r))
        q = dense_q(q, drafter.q_vocab, model.config.vocab_size)  # [B, k, V]
        seq, n = np.asarray(st.seq), np.asarray(st.cache.lengths)
        out.append([(seq[b, : n[b] + 1], np.asarray(toks[b]),
                     None if q is None else np.asarray(q[b])) for b in range(2)])
        st = rnd(st)
    return out


def check_logps(q, ref_logp, vocab):
    """jspec's q at temperature 1 against the reference log-softmax over the draft vocab."""
    np.testing.assert_allclose(np.log(np.maximum(q[:, vocab], 1e-30)), ref_logp.numpy(),
                               atol=ATOL, rtol=0)
    assert np.all(np.delete(q, vocab, axis=1) < 1e-12)  # zero outside the draft vocabulary


@pytest.mark.parametrize("arch,own_embed,layer_field,nbr", [
    ("llama", False, "vllm", False), ("llama", True, "sglang", False),
    ("qwen3", False, "default", False), ("llama", False, "vllm", True)])
def test_eagle3_matches_the_reference(tmp_path, arch, own_embed, layer_field, nbr):
    model, hf = targets(arch, str(tmp_path.parent / f"hf-{arch}"))
    ref, hf_ids = write_eagle3(tmp_path / "ckpt", model, own_embed=own_embed,
                               layer_field=layer_field, nbr=nbr)
    drafter = jspec.load_drafter(str(tmp_path / "ckpt"), target=model)
    assert drafter.cfg.feature_layers == tuple(hf_ids)
    vocab = np.asarray(drafter.vocab_ids)
    embed = ref.embed_tokens if own_embed else hf.model.embed_tokens
    k = 3
    with torch.no_grad():
        for temperature in (0.0, 1.0):
            for per_row in jspec_rounds(model, drafter, k, rounds=2, temperature=temperature):
                for tokens, drafts, q in per_row:
                    hs = hidden_states(hf, tokens[:-1])
                    chain = None if q is None else drafts
                    want, logp = ref.draft(hs, hf_ids, tokens, k, chain, embed)
                    if q is None:
                        assert list(drafts) == want
                    else:
                        check_logps(q, logp, vocab)


@pytest.mark.parametrize("arch,k", [("qwen3", 4), ("llama", 2)])
def test_dflash_matches_the_reference(tmp_path, arch, k):
    model, hf = targets(arch, str(tmp_path.parent / f"hf-{arch}"))
    ref, ids = write_dflash(tmp_path / "ckpt", model, block=5)
    drafter = jspec.load_drafter(str(tmp_path / "ckpt"), target=model)
    assert drafter.cfg.feature_layers == (1, 3) and drafter.cfg.block == 5
    vocab = np.arange(model.config.vocab_size)
    with torch.no_grad():
        for temperature in (0.0, 1.0):
            for per_row in jspec_rounds(model, drafter, k, rounds=2, temperature=temperature):
                for tokens, drafts, q in per_row:
                    hs = hidden_states(hf, tokens[:-1])
                    want, logp = ref.draft(hf, hs, ids, tokens, k, model.config.vocab_size - 1)
                    if q is None:
                        assert list(drafts) == want
                    else:
                        check_logps(q, logp, vocab)


def test_jspec_features_are_hf_hidden_states(tmp_path):
    """jspec's feature layer i is HF's hidden_states[i] (the input of decoder layer i)."""
    model, hf = targets("llama", str(tmp_path.parent / "hf-llama"))
    toks = np.asarray(PROMPTS[1], np.int32)
    out = jspec.forward(model.config, model.weights, jnp.asarray(toks[None]),
                        jnp.arange(len(toks))[None], jspec.KVCache.create(model.config, 1, 32),
                        hidden_layers=(0, 1, 2, 3))
    hs = hidden_states(hf, toks)
    for i in range(4):
        np.testing.assert_allclose(np.asarray(out.hidden[i, 0]), hs[i][0].numpy(), atol=1e-4)
