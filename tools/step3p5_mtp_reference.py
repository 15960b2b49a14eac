#!/usr/bin/env python3
"""An independent reference of Step3.5's MTP layers (chained draft heads), and the fixture the
worker's Step3.5 speculative-decoding tests compare against.

transformers has no Step3.5 causal LM; its Step3p7 classes implement the same layers
(docs/models.md), and its own MTP chain feeds each head the previous one's output after the
norm, where the hub code and vLLM (step3p5_mtp.py, read, not copied) feed it before. So this
writes the chain from the published structure and calls transformers' Step3p7 decoder layer,
norm and rotary modules for the blocks:

    head j (checkpoint layer N + j, N = num_hidden_layers) at position p:
        z[-1][p] = the target's last layer output at p, before model.norm
        z[j][p] = block_{N+j}(eh_proj([enorm(embed(x[p+1+j])) ; hnorm(z[j-1][p])]))
                  rotary position p, attention (full or sliding, by layer_types[N + j]) over the
                  head's own keys of positions 0..p; the MLP dense or MoE by moe_layers_enum
        logits[j][p] = shared_head.output(shared_head.norm(z[j][p]))      a draft of x[p+2+j]
    (embed: the target's; every norm zero-centred, weight 1 + w.)

    step3p5_mtp_reference.py make --out DIR [--steps 300]
        DIR/model: tests/data/step3p5's tiny target (rebuilt from make_fixtures.py's seeds and
        checked against its expected logits) with three MTP layers (sliding / full / sliding;
        the middle one MoE, the first with a clamped dense MLP), trained together on the
        target's own greedy continuations so that drafts are accepted as a released head's are;
        DIR/expected_mtp.safetensors: per prompt i, `prompt.i`, `hidden.i` (the target's
        hidden states before the final norm), `mtp_logits.i.j` [len - 1 - j, vocab] (head j at
        positions 0 .. len - 2 - j, every input token known), `greedy.i` (the target's 16
        greedy tokens) and `kept3.i` (the drafts kept decoding them with 3 drafts a step, the
        later heads reading the earlier ones' drafts); DIR/mtp_stats.json: the loss and each
        head's acceptance.

    step3p5_mtp_reference.py adapter --fixture DIR
        DIR/adapter_mtp: a 3D PEFT adapter (PEFT itself, on a module holding the decoder's
        layers and the MTP layers' blocks at their checkpoint indices) on every attention
        projection and head gate, the dense MLPs, the shared experts and the fused experts;
        DIR/expected_mtp_adapter.safetensors: `hidden.i` and `mtp_logits.i.j` with the adapter
        applied to the target and the heads, and `greedy.i`, the adapted target's greedy tokens.

Test-only: the product never runs Python.
"""
import argparse
import json
import os
import shutil
import sys

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures as mf  # noqa: E402
from mtp_reference import greedy  # noqa: E402
from transformers.models.step3p7.configuration_step3p7 import Step3p7TextConfig  # noqa: E402
from transformers.models.step3p7.modeling_step3p7 import (  # noqa: E402
    Step3p7DecoderLayer, Step3p7RMSNorm, Step3p7RotaryEmbedding)

N, MTP = mf.S35_LAYERS, 3
TYPES = mf.S35["layer_types"][:N] + ["sliding_attention", "full_attention", "sliding_attention"]
THETA = {"full_attention": 500000.0, "sliding_attention": 10000.0}
PARTIAL = {"full_attention": 0.5, "sliding_attention": 1.0}
# The hub config: the decoder's entries, then the MTP layers'.
CONFIG = dict(mf.S35, num_nextn_predict_layers=MTP, layer_types=TYPES,
              rope_theta=[THETA[t] for t in TYPES], partial_rotary_factors=[PARTIAL[t] for t in TYPES],
              moe_layers_enum="1,2,3,5",
              swiglu_limits=mf.S35["swiglu_limits"][:N] + [0.0, 0.4, 0.0],
              swiglu_limits_shared=mf.S35["swiglu_limits_shared"][:N] + [0.7, 0.0, 0.0])
GREEDY = 16


def all_layers_config():
    """A Step3p7 config whose layers are the decoder's and the MTP layers (so that transformers
    builds layer N + j with that layer's heads, rotary type, MLP kind and clamps)."""
    kw = {k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type")}
    kw.update(num_hidden_layers=N + MTP, num_nextn_predict_layers=0)
    cfg = Step3p7TextConfig(**kw)
    cfg._attn_implementation = "eager"
    assert cfg.mlp_layer_types[N:] == ["dense", "sparse", "dense"], cfg.mlp_layer_types
    return cfg


class Head(torch.nn.Module):
    """One MTP layer under its checkpoint names (without `model.layers.{N + j}.`); `block` holds
    the decoder layer's own names."""

    def __init__(self, cfg, layer):
        super().__init__()
        H, V = cfg.hidden_size, cfg.vocab_size
        self.enorm = Step3p7RMSNorm(H, eps=cfg.rms_norm_eps)
        self.hnorm = Step3p7RMSNorm(H, eps=cfg.rms_norm_eps)
        self.eh_proj = torch.nn.Linear(2 * H, H, bias=False)
        self.block = Step3p7DecoderLayer(cfg, layer)
        self.shared_norm = Step3p7RMSNorm(H, eps=cfg.rms_norm_eps)
        self.shared_output = torch.nn.Linear(H, V, bias=False)
        self.type = cfg.layer_types[layer]
        self.window = cfg.sliding_window

    def forward(self, emb, hidden, rotary):
        """emb [B, n, H]: embed(x[p+1+j]); hidden [B, n, H]: z[j-1][p]; positions 0..n-1.
        Returns z[j] [B, n, H] (before the head's norm)."""
        B, n, _ = emb.shape
        z = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], -1))
        pos = torch.arange(n).view(1, n).expand(B, n)
        q = torch.arange(n).view(n, 1)
        k = torch.arange(n).view(1, n)
        allowed = k <= q
        if self.type == "sliding_attention":
            allowed &= k > q - self.window
        mask = torch.zeros(n, n).masked_fill(~allowed, float("-inf")).view(1, 1, n, n)
        return self.block(z, attention_mask=mask, position_embeddings=rotary(z, pos, self.type),
                          position_ids=pos)

    def logits(self, z):
        return self.shared_output(self.shared_norm(z))


def prenorm_hidden(base, ids):
    """The target's last layer output before model.norm [B, n, H]."""
    got = {}
    hook = base.model.norm.register_forward_pre_hook(lambda mod, args: got.setdefault("h", args[0]))
    try:
        with torch.no_grad():
            base.model(input_ids=ids)
    finally:
        hook.remove()
    return got["h"]


def chain(base, heads, rotary, ids, hidden=None):
    """Each head's output over ids [B, n] (every input token known): a list of [B, n - 1 - j, H]
    (shorter when the sequence is: n - 1 - j > 0)."""
    if hidden is None:
        hidden = prenorm_hidden(base, ids)
    outs, prev = [], hidden
    for j, head in enumerate(heads):
        m = ids.shape[1] - 1 - j
        if m <= 0:
            break  # no position with every input of head j known
        emb = base.model.embed_tokens(ids[:, 1 + j:])
        z = head(emb, prev[:, :m], rotary)
        outs.append(z)
        prev = z
    return outs


def speculate(base, heads, rotary, prompt, k, n):
    """Greedy speculative decoding as the engine runs it, for `n` tokens after `prompt`: each step
    drafts k tokens (fewer when the tokens left allow fewer: at most n - generated - 1), draft
    j + 1 from head j at the target's last position, its inputs the known tokens and the drafts
    before it; the target keeps the longest agreeing prefix and adds its own. Returns the drafts
    kept in all."""
    full = list(prompt) + greedy(base, prompt, n)
    length, gen, kept = len(prompt), 1, 0
    hidden = prenorm_hidden(base, torch.tensor([full]))
    while gen < n:
        d = min(k, n - gen - 1)
        drafts = []
        prev = hidden[:, :length]
        for j in range(d):
            # Head j over positions 0 .. length - 1: token p + 1 + j, known up to `length`.
            toks = [full[p + 1 + j] if p + 1 + j <= length else drafts[p + j - length]
                    for p in range(length)]
            with torch.no_grad():
                z = heads[j](base.model.embed_tokens(torch.tensor([toks])), prev, rotary)
                drafts.append(int(heads[j].logits(z)[0, -1].argmax()))
            prev = z
        a = 0
        while a < d and drafts[a] == full[length + 1 + a]:
            a += 1
        kept += a
        gen += a + 1
        length += a + 1
    return kept


def to_hub(head, layer):
    """The head's checkpoint tensors, as the hub names an MTP layer's."""
    p = f"model.layers.{layer}."
    sd = {p + "enorm.weight": head.enorm.weight, p + "hnorm.weight": head.hnorm.weight,
          p + "eh_proj.weight": head.eh_proj.weight,
          p + "shared_head.norm.weight": head.shared_norm.weight,
          p + "shared_head.output.weight": head.shared_output.weight}
    sd.update(mf.s35_to_hub({p + k: v for k, v in head.block.state_dict().items()}))
    return {k: v.detach().contiguous() for k, v in sd.items()}


def make(out, steps):
    shutil.rmtree(out, ignore_errors=True)
    mdir = os.path.join(out, "model")
    cfg, base, _ = mf.s35_base()
    # The target is tests/data/step3p5's.
    committed = load_file(os.path.join(os.path.dirname(__file__), "..", "tests", "data", "step3p5",
                                       "expected_logits.safetensors"))
    for k, p in enumerate(mf.S35_PROMPTS):
        assert (mf.logits_of(base, p) - committed[f"logits.base.{k}"]).abs().max().item() < 1e-6
    for p in base.parameters():
        p.requires_grad_(False)
    acfg = all_layers_config()
    rotary = Step3p7RotaryEmbedding(acfg)
    torch.manual_seed(353)
    heads = torch.nn.ModuleList([Head(acfg, N + j) for j in range(MTP)])
    heads.apply(base.model._init_weights)
    mf.s35_randomise(heads, torch.Generator().manual_seed(354))

    # Training: the target's greedy continuations of random prompts (32 tokens each); head j at
    # position p sees x[p+1+j] and z[j-1][p] and must predict x[p+2+j] (the heads together).
    g = torch.Generator().manual_seed(355)
    seqs = []
    for _ in range(48):
        prompt = torch.randint(0, mf.VOCAB, (6,), generator=g).tolist()
        seqs.append(prompt + greedy(base, prompt, 26))
    # And the first test prompt's (its drafts are then mostly kept; the others' are held out).
    first = mf.S35_PROMPTS[0]
    seqs.append(first + greedy(base, first, 32 - len(first)))
    ids = torch.tensor(seqs)
    hidden = prenorm_hidden(base, ids)
    opt = torch.optim.Adam(heads.parameters(), lr=3e-3)
    for _ in range(steps):
        zs = chain(base, heads, rotary, ids, hidden)
        loss = 0
        for j, z in enumerate(zs):
            lg = heads[j].logits(z)[:, :-1]
            loss = loss + torch.nn.functional.cross_entropy(lg.reshape(-1, mf.VOCAB),
                                                            ids[:, 2 + j:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    heads.eval()

    os.makedirs(mdir)
    sd = mf.s35_to_hub({k: v for k, v in base.state_dict().items() if "inv_freq" not in k})
    for j, head in enumerate(heads):
        sd.update(to_hub(head, N + j))
    save_file(sd, os.path.join(mdir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(mdir, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=2)

    expected, stats = {}, {"train_loss": float(loss.detach()), "steps": steps, "prompts": []}
    for i, p in enumerate(mf.S35_PROMPTS):
        ids = torch.tensor([p])
        h = prenorm_hidden(base, ids)
        with torch.no_grad():
            zs = chain(base, heads, rotary, ids, h)
        expected[f"prompt.{i}"] = torch.tensor(p, dtype=torch.int64)
        expected[f"hidden.{i}"] = h[0].contiguous()
        for j, z in enumerate(zs):
            expected[f"mtp_logits.{i}.{j}"] = heads[j].logits(z)[0].detach().contiguous()
        cont = greedy(base, p, GREEDY)
        expected[f"greedy.{i}"] = torch.tensor(cont, dtype=torch.int64)
        # Drafts kept decoding the 16 greedy tokens with 3 drafts a step.
        expected[f"kept3.{i}"] = torch.tensor([speculate(base, heads, rotary, p, 3, GREEDY)],
                                              dtype=torch.int64)
        # Each head's acceptance on the target's own continuation (its inputs all known): head
        # j's draft at position p against the token the target wrote at p + 2 + j.
        full = torch.tensor([p + cont])
        with torch.no_grad():
            zs = chain(base, heads, rotary, full)
        acc = []
        for j, z in enumerate(zs):
            drafts = heads[j].logits(z)[0].argmax(-1)  # drafts[q] of x[q + 2 + j]
            hits = [int(drafts[q - 2 - j]) == int(full[0, q])
                    for q in range(max(len(p), 2 + j), full.shape[1])]
            acc.append(sum(hits) / len(hits))
        stats["prompts"].append({"prompt": i, "acceptance_by_head": acc})
    save_file(expected, os.path.join(out, "expected_mtp.safetensors"))
    json.dump(stats, open(os.path.join(out, "mtp_stats.json"), "w"), indent=2)
    print(json.dumps(stats))


def block_from_hub(block, sd, p):
    """The block's state dict (transformers' names) from the hub checkpoint `sd` at layer prefix
    `p`: the inverse of make_fixtures.s35_to_hub."""
    out = {}
    for k in block.state_dict():
        full = p + k
        if k.endswith("mlp.experts.gate_up_proj"):
            q = full[:-len(".mlp.experts.gate_up_proj")]
            out[k] = torch.cat([sd[q + ".moe.gate_proj.weight"], sd[q + ".moe.up_proj.weight"]], 1)
        elif k.endswith("mlp.experts.down_proj"):
            out[k] = sd[full[:-len(".mlp.experts.down_proj")] + ".moe.down_proj.weight"]
        elif k.endswith("mlp.gate.weight"):
            out[k] = sd[full.replace(".mlp.gate.weight", ".moe.gate.weight")]
        elif k.endswith("mlp.gate.e_score_correction_bias"):
            out[k] = sd[full.replace(".mlp.gate.e_score_correction_bias", ".moe.router_bias")]
        else:
            out[k] = sd[full.replace(".mlp.shared_experts.", ".share_expert.")]
    return out


def load_fixture(fixture):
    """The fixture's target and heads, read back from its checkpoint."""
    _, base, _ = mf.s35_base()
    acfg = all_layers_config()
    heads = torch.nn.ModuleList([Head(acfg, N + j) for j in range(MTP)])
    sd = load_file(os.path.join(fixture, "model", "model.safetensors"))
    with torch.no_grad():
        for j, head in enumerate(heads):
            p = f"model.layers.{N + j}."
            head.enorm.weight.copy_(sd[p + "enorm.weight"])
            head.hnorm.weight.copy_(sd[p + "hnorm.weight"])
            head.eh_proj.weight.copy_(sd[p + "eh_proj.weight"])
            head.shared_norm.weight.copy_(sd[p + "shared_head.norm.weight"])
            head.shared_output.weight.copy_(sd[p + "shared_head.output.weight"])
            head.block.load_state_dict(block_from_hub(head.block, sd, p))
            for k, v in to_hub(head, N + j).items():
                assert (v - sd[k]).abs().max().item() == 0, k
    heads.eval()
    return base, heads, Step3p7RotaryEmbedding(acfg)


def adapter(fixture):
    """DIR/adapter_mtp: a 3D PEFT adapter (PEFT itself) on the target and the MTP layers, whose
    blocks sit at their checkpoint indices (model.layers.N + j.*): attention with its head gate,
    the dense MLPs, the MoE layers' shared expert and fused experts. DIR/
    expected_mtp_adapter.safetensors: per prompt i, `hidden.i` and `mtp_logits.i.j` with the
    adapter applied to the target and the heads, and `greedy.i`, the adapted target's greedy
    tokens."""
    from peft import LoraConfig, get_peft_model
    base, heads, rotary = load_fixture(fixture)
    ref = load_file(os.path.join(fixture, "expected_mtp.safetensors"))
    for i, p in enumerate(mf.S35_PROMPTS):
        zs = chain(base, heads, rotary, torch.tensor([p]))
        for j, z in enumerate(zs):
            got = heads[j].logits(z)[0]
            assert (got - ref[f"mtp_logits.{i}.{j}"]).abs().max().item() < 1e-5

    class Joint(torch.nn.Module):
        """The checkpoint's module paths: the decoder's layers and the MTP layers' blocks under
        model.layers."""

        def __init__(self):
            super().__init__()
            self.model = torch.nn.Module()
            self.model.layers = torch.nn.ModuleList(list(base.model.layers) + [h.block for h in heads])

    torch.manual_seed(41)
    lc = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=mf.S35_LINEAR,
                    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    pm = get_peft_model(Joint(), lc)
    with torch.no_grad():  # smaller B: the adapted heads still draft well
        for name, q in pm.named_parameters():
            if "lora_B" in name:
                q.mul_(0.3)
    out = os.path.join(fixture, "adapter_mtp")
    shutil.rmtree(out, ignore_errors=True)
    pm.save_pretrained(out)
    readme = os.path.join(out, "README.md")
    if os.path.exists(readme):
        os.remove(readme)
    names = load_file(os.path.join(out, "adapter_model.safetensors")).keys()
    assert any(f".model.layers.{N + 1}.mlp.experts." in k for k in names), sorted(names)[:8]
    assert any(f".model.layers.{N}.mlp.down_proj." in k for k in names)
    expected = {}
    for i, p in enumerate(mf.S35_PROMPTS):
        ids = torch.tensor([p])
        h = prenorm_hidden(base, ids)  # the target's modules now carry the adapter
        with torch.no_grad():
            zs = chain(base, heads, rotary, ids, h)
        expected[f"hidden.{i}"] = h[0].contiguous()
        for j, z in enumerate(zs):
            lg = heads[j].logits(z)[0].detach()
            assert (lg - ref[f"mtp_logits.{i}.{j}"]).abs().max().item() > 1e-3
            expected[f"mtp_logits.{i}.{j}"] = lg.contiguous()
        expected[f"greedy.{i}"] = torch.tensor(greedy(base, p, GREEDY), dtype=torch.int64)
    save_file(expected, os.path.join(fixture, "expected_mtp_adapter.safetensors"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--out", required=True)
    m.add_argument("--steps", type=int, default=300)
    ad = sub.add_parser("adapter")
    ad.add_argument("--fixture", required=True)
    args = ap.parse_args()
    torch.set_num_threads(2)
    if args.cmd == "make":
        make(args.out, args.steps)
    elif args.cmd == "adapter":
        adapter(args.fixture)


if __name__ == "__main__":
    main()
