#!/usr/bin/env python3
"""An independent reference of Qwen3.5-MoE's MTP (multi-token prediction) head, and the fixture
the worker's MTP tests compare against. transformers ignores the checkpoint's `mtp.*` weights
(`_keys_to_ignore_on_load_unexpected`), so this writes the head from its published structure
(the semantics of vLLM's qwen3_5_mtp.py, read, not copied), reusing transformers' decoder layer,
norm and rotary modules for the parts they share with the target:

    for draft position p (the target has seen x[0..p] and produced h[p], its hidden state after
    the final norm):
        e = zcRMS(mtp.pre_fc_norm_embedding)(embed(x[p+1]))       embeddings shared with the target
        h = zcRMS(mtp.pre_fc_norm_hidden)(h[p])
        z = mtp.fc([e ; h])                                        [H, 2H], no bias, embedding first
        z = mtp.layers.0(z) at rotary position p                   full attention over the head's own
                                                                   keys of positions 0..p, MoE + shared expert
        logits = lm_head(zcRMS(mtp.norm)(z))                       a draft of x[p+2]
    (zcRMS: the zero-centred RMSNorm of the target, weight 1 + w.)

    mtp_reference.py make --out DIR [--steps 400]
        DIR/model: a tiny Qwen3.5-MoE checkpoint (the shape of tests/data/qwen3_5_moe) with
        "mtp_num_hidden_layers": 1 and an MTP head trained on the target's own greedy
        continuations (so that drafts are accepted as often as a released head's are);
        DIR/expected_mtp.safetensors: per prompt i, `prompt.i` (ids), `hidden.i` (the target's
        post-norm hidden states), `mtp_logits.i` [len - 1, vocab] (the head's logits at each
        position), `greedy.i` (the target's 16 greedy tokens after the prompt) and the head's
        acceptance on them (in DIR/mtp_stats.json).

    mtp_reference.py adapter --fixture DIR
        DIR/adapter_mtp: a 3D PEFT adapter (PEFT itself, on a module holding the target as
        `model` and the head as `mtp`) on the attention projections, the shared expert and the
        fused experts of every layer, the head's included (`mtp.layers.0.*`); DIR/
        expected_mtp_adapter.safetensors: per prompt i, `hidden.i` and `mtp_logits.i` with the
        adapter applied to both, and `greedy.i`, the adapted target's greedy tokens.

    mtp_reference.py medium --out DIR [--layers 12] [--steps 300]
        DIR/model: the speculative-decoding benchmark's model (bench/decode_step --only
        mtp-speed): bench/decode_step's medium Qwen3.5 dimensions (H=1024, E=32 top-8, vocab
        4096) with --layers layers (3 Gated DeltaNet : 1 attention), random, and an MTP head
        trained as above on the target's greedy continuations of 64 random prompts; DIR/
        mtp_stats.json: the loss, and the head's acceptance on those continuations and on
        held-out prompts' (a random target's next tokens are not learnable from so few: near 0);
        DIR/prompts.json: both sets of prompts.

    mtp_reference.py mm --out DIR [--steps 300]
        DIR/model: tests/data/qwen3_5_moe_mm's multimodal target with a head trained on its
        greedy continuations of random text prompts and of the fixture's image prompts;
        DIR/expected_mtp.safetensors: per image prompt i, `prompt.i`, the target's `greedy.i`
        (16 tokens) and over prompt + greedy tokens its rotary streams `positions.i` [3, n], the
        tower's embeddings of the image tokens `image_embeds.i`, its hidden states `hidden.i`,
        the head's `mtp_logits.i` [n - 1, vocab] (its input at an image token the tower's
        embedding, its rotary streams the target's at p) and their argmax `drafts.i`.

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
from transformers import Qwen3_5MoeForCausalLM  # noqa: E402
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig  # noqa: E402
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (  # noqa: E402
    Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm, Qwen3_5MoeTextRotaryEmbedding)

EAGER = dict(attn_implementation="eager", experts_implementation="eager")
# The tiny target: tests/data/qwen3_5_moe's dimensions (make_fixtures.py's Q35).
H, I, E, VOCAB = 24, 10, 4, 96
Q35 = dict(vocab_size=VOCAB, hidden_size=H, moe_intermediate_size=I, shared_expert_intermediate_size=12,
           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
           num_experts=E, num_experts_per_tok=2, max_position_embeddings=256, rms_norm_eps=1e-6,
           layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
           linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
           linear_value_head_dim=6, linear_conv_kernel_dim=4,
           rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                            "mrope_section": [1, 1, 0], "mrope_interleaved": True})
PROMPTS = [[1, 17, 42, 5, 88], [3, 9, 27, 81, 50, 11, 60], [(7 * i + 3) % VOCAB for i in range(40)]]
GREEDY = 16


class MtpHead(torch.nn.Module):
    """The head's parameters under their checkpoint names (without the `mtp.` prefix)."""

    def __init__(self, cfg):
        super().__init__()
        # transformers builds a layer's mixer from config.layer_types[layer_idx]: the head's layer
        # is always full attention, so it gets a config whose only layer is one.
        lcfg = Qwen3_5MoeTextConfig(**{**cfg.to_dict(), "num_hidden_layers": 1,
                                       "layer_types": ["full_attention"]})
        lcfg._attn_implementation = "eager"
        lcfg._experts_implementation = "eager"
        self.fc = torch.nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5MoeRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3_5MoeRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = torch.nn.ModuleList([Qwen3_5MoeDecoderLayer(lcfg, 0)])
        self.norm = Qwen3_5MoeRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rotary = Qwen3_5MoeTextRotaryEmbedding(config=lcfg)

    def forward(self, embeds, hidden, pos=None):
        """embeds [B, n, H]: embed(x[p+1]); hidden [B, n, H]: h[p]; pos [3, B, n]: the target's
        rotary streams at p (default: 0..n-1 on each). Returns the head's output after mtp.norm
        [B, n, H]."""
        B, n, _ = embeds.shape
        z = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], -1))
        if pos is None:
            pos = torch.arange(n).view(1, 1, n).expand(3, B, n)
        mask = torch.full((n, n), float("-inf")).triu(1).view(1, 1, n, n)
        z = self.layers[0](z, position_embeddings=self.rotary(z, pos), attention_mask=mask,
                           position_ids=pos[0])
        return self.norm(z)


def new_head(model, cfg):
    """A head initialised as transformers initialises the target's layers (the head is no
    PreTrainedModel, so nothing else would: its router and fused experts would stay as
    torch.empty left them, a zero router making every expert tie)."""
    head = MtpHead(cfg)
    head.apply(model._init_weights)
    return head


def target_hidden(model, ids):
    """The target's hidden states after the final norm, [1, n, H]."""
    with torch.no_grad():
        return model.model(input_ids=torch.tensor([ids])).last_hidden_state


def head_logits(model, head, ids, hidden=None):
    """The head's logits at positions 0..n-2 (drafts of x[2..n]) for prompt ids [n]."""
    if hidden is None:
        hidden = target_hidden(model, ids)
    emb = model.model.embed_tokens(torch.tensor([ids[1:]]))
    return model.lm_head(head(emb, hidden[:, :-1]))[0]


def greedy(model, ids, n):
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(input_ids=torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


def randomise_norms(model, seed):
    """transformers initialises the zero-centred norms to 0 and dt_bias to 1: randomise them
    (as make_fixtures.py's q35_randomise) so that every path of the forward matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if "linear_attn.norm" in name else 0.0))
            elif name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g) * 2.0 - 1.0)
            elif name.endswith("dt_bias") or name.endswith("shared_expert_gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def continuations(model, vocab, count, seed, prompt_len=6, new=26):
    """`count` random prompts of `prompt_len` ids, each followed by the target's `new` greedy
    tokens (generate with its cache: the medium model is too slow without)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab, (count, prompt_len), generator=g)
    with torch.no_grad():
        out = model.generate(prompts, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out.tolist()


def train_head(model, head, steps, seed, vocab=VOCAB, count=48, lr=3e-3, seqs=None):
    """Trains the head on the target's greedy continuations of random prompts: at each position
    p of a sequence the target wrote, the head sees (x[p+1], h[p]) and must predict x[p+2]."""
    if seqs is None:
        g = torch.Generator().manual_seed(seed)
        seqs = []
        for _ in range(count):
            prompt = torch.randint(0, vocab, (6,), generator=g).tolist()
            seqs.append(prompt + greedy(model, prompt, 26))
    ids = torch.tensor(seqs)
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
        emb = model.model.embed_tokens(ids[:, 1:])
    target = ids[:, 2:]
    opt = torch.optim.Adam(head.parameters(), lr=lr)
    for _ in range(steps):
        logits = model.lm_head(head(emb, hidden[:, :-1]))[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss.detach())


def save_with_head(model, head, mdir):
    """The checkpoint: the target's weights as make_fixtures.py writes them (fused experts) and
    the head under mtp.* (rotary buffers are not weights), its config declaring the head."""
    model.save_pretrained(mdir)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    for k, v in head.state_dict().items():
        if not k.startswith("rotary."):
            sd["mtp." + k] = v.detach().contiguous()
    save_file(sd, os.path.join(mdir, "model.safetensors"), metadata={"format": "pt"})
    c = json.load(open(os.path.join(mdir, "config.json")))
    c["mtp_num_hidden_layers"] = 1
    c["mtp_use_dedicated_embeddings"] = False
    json.dump(c, open(os.path.join(mdir, "config.json"), "w"), indent=2)


def make(out, steps):
    shutil.rmtree(out, ignore_errors=True)
    mdir = os.path.join(out, "model")
    cfg = Qwen3_5MoeTextConfig(**Q35, **EAGER)
    cfg.architectures = ["Qwen3_5MoeForCausalLM"]
    torch.manual_seed(5432)
    model = Qwen3_5MoeForCausalLM(cfg).eval()
    randomise_norms(model, 98)
    for p in model.parameters():
        p.requires_grad_(False)
    torch.manual_seed(77)
    head = new_head(model, cfg)
    randomise_norms(head, 97)
    untrained = {p: head_logits(model, head, p) for p in map(tuple, PROMPTS)}
    loss = train_head(model, head, steps, 11)
    head.eval()
    save_with_head(model, head, mdir)
    # transformers reads the checkpoint back (ignoring mtp.*) to the same target.
    back = Qwen3_5MoeForCausalLM.from_pretrained(mdir, dtype=torch.float32, **EAGER).eval()
    expected, stats = {}, {"train_loss": loss, "prompts": []}
    for i, p in enumerate(PROMPTS):
        hidden = target_hidden(model, p)
        assert (hidden - target_hidden(back, p)).abs().max().item() < 1e-6
        with torch.no_grad():
            lg = head_logits(model, head, p, hidden)
        expected[f"prompt.{i}"] = torch.tensor(p, dtype=torch.int64)
        expected[f"hidden.{i}"] = hidden[0].contiguous()
        expected[f"mtp_logits.{i}"] = lg.contiguous()
        cont = greedy(model, p, GREEDY)
        expected[f"greedy.{i}"] = torch.tensor(cont, dtype=torch.int64)
        # Acceptance on the target's own continuation: the head's draft at each position of
        # prompt + continuation against the token the target wrote there.
        full = p + cont
        with torch.no_grad():
            drafts = head_logits(model, head, full).argmax(-1)[len(p) - 2:]
            before = untrained[tuple(p)]
        want = torch.tensor(full[len(p):])
        acc = float((drafts[:len(want)] == want).float().mean())
        stats["prompts"].append({"prompt": i, "acceptance": acc,
                                 "untrained_logits_changed": bool((before - lg).abs().max() > 1e-3)})
    save_file(expected, os.path.join(out, "expected_mtp.safetensors"))
    json.dump(stats, open(os.path.join(out, "mtp_stats.json"), "w"), indent=2)
    print(json.dumps(stats))


# bench/decode_step's medium Qwen3.5 (Q35Dims), but for the number of layers.
MEDIUM = dict(vocab_size=4096, hidden_size=1024, moe_intermediate_size=512,
              shared_expert_intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
              head_dim=128, num_experts=32, num_experts_per_tok=8, max_position_embeddings=4096,
              rms_norm_eps=1e-6, linear_num_key_heads=4, linear_num_value_heads=8,
              linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                               "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                               "mrope_interleaved": True})


def medium(out, layers, steps):
    shutil.rmtree(out, ignore_errors=True)
    mdir = os.path.join(out, "model")
    types = ["full_attention" if (l + 1) % 4 == 0 else "linear_attention" for l in range(layers)]
    cfg = Qwen3_5MoeTextConfig(**MEDIUM, num_hidden_layers=layers, layer_types=types, **EAGER)
    cfg.architectures = ["Qwen3_5MoeForCausalLM"]
    torch.manual_seed(2024)
    model = Qwen3_5MoeForCausalLM(cfg).eval()
    randomise_norms(model, 31)
    for p in model.parameters():
        p.requires_grad_(False)
    torch.manual_seed(78)
    head = new_head(model, cfg)
    randomise_norms(head, 79)
    train = continuations(model, MEDIUM["vocab_size"], 64, 12)
    held_out = continuations(model, MEDIUM["vocab_size"], 16, 13)
    loss = train_head(model, head, steps, 0, vocab=MEDIUM["vocab_size"], lr=1e-3, seqs=train)
    head.eval()
    save_with_head(model, head, mdir)

    def acceptance(seqs):
        hit = total = 0
        for s in seqs:
            with torch.no_grad():
                drafts = head_logits(model, head, s).argmax(-1)[5:]  # drafts of x[7..]
            want = torch.tensor(s[7:])
            hit += int((drafts[:len(want)] == want).sum())
            total += len(want)
        return hit / total

    distinct = len({t for s in held_out for t in s[6:]})
    stats = {"train_loss": loss, "train_acceptance": acceptance(train),
             "held_out_acceptance": acceptance(held_out), "held_out_distinct_tokens": distinct,
             "layers": layers, "steps": steps}
    json.dump(stats, open(os.path.join(out, "mtp_stats.json"), "w"), indent=2)
    # The prompts whose continuations the head learnt, and held-out ones, for the benchmark.
    json.dump({"trained": [s[:6] for s in train], "held_out": [s[:6] for s in held_out]},
              open(os.path.join(out, "prompts.json"), "w"))
    print(json.dumps(stats))


def adapter(fixture):
    from peft import LoraConfig, get_peft_model
    mdir = os.path.join(fixture, "model")
    model = Qwen3_5MoeForCausalLM.from_pretrained(mdir, dtype=torch.float32, **EAGER).eval()
    head = MtpHead(model.config)
    sd = {k[len("mtp."):]: v for k, v in load_file(os.path.join(mdir, "model.safetensors")).items()
          if k.startswith("mtp.")}
    missing, unexpected = head.load_state_dict(sd, strict=False)
    assert not unexpected and all(k.startswith("rotary.") for k in missing), (missing, unexpected)
    head.eval()

    class Joint(torch.nn.Module):
        """The checkpoint's module paths: the target under `model.`, the head under `mtp.`."""

        def __init__(self):
            super().__init__()
            self.model = model.model
            self.mtp = head

    torch.manual_seed(31)
    lc = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                    "down_proj"],
                    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    pm = get_peft_model(Joint(), lc)
    # PEFT's random B is of the scale of A: smaller, so the adapted head still drafts well.
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.mul_(0.3)
    out = os.path.join(fixture, "adapter_mtp")
    shutil.rmtree(out, ignore_errors=True)
    pm.save_pretrained(out)
    names = load_file(os.path.join(out, "adapter_model.safetensors")).keys()
    assert any(".mtp.layers.0." in k for k in names) and any(".model.layers.0." in k for k in names)
    expected = {}
    for i, p in enumerate(PROMPTS):
        hidden = target_hidden(model, p)  # the target's modules now carry the adapter
        with torch.no_grad():
            lg = head_logits(model, head, p, hidden)
        expected[f"hidden.{i}"] = hidden[0].contiguous()
        expected[f"mtp_logits.{i}"] = lg.contiguous()
        expected[f"greedy.{i}"] = torch.tensor(greedy(model, p, GREEDY), dtype=torch.int64)
    save_file(expected, os.path.join(fixture, "expected_mtp_adapter.safetensors"))


def mm(out, steps):
    """The multimodal target of tests/data/qwen3_5_moe_mm with a trained head, and the head's
    drafts over image prompts: its inputs at an image token are the tower's embeddings (as the
    target's), its rotary streams the target's multimodal positions."""
    import make_vision_fixtures as mv
    from transformers import Qwen3_5MoeForConditionalGeneration
    shutil.rmtree(out, ignore_errors=True)
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "qwen3_5_moe_mm")
    model = Qwen3_5MoeForConditionalGeneration.from_pretrained(os.path.join(src, "model"), dtype=torch.float32,
                                                               **EAGER).eval()
    processor = mv.Qwen2VLImageProcessorPil(**{k: v for k, v in mv.PROCESSOR.items()
                                              if k not in ("image_processor_type", "processor_class")})
    for p in model.parameters():
        p.requires_grad_(False)
    cfg = model.config.text_config
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    lm, embed = model.model.language_model, model.get_input_embeddings()
    torch.manual_seed(79)
    head = new_head(lm, cfg)  # initialised as the language model's layers
    randomise_norms(head, 80)

    def target(ids, pix, grids):
        """Logits, hidden states after the final norm, the embeddings the language model read,
        and its multimodal rotary streams [3, 1, n], for one sequence."""
        got = {}

        def hook(mod, args, kwargs):
            got["embeds"] = kwargs["inputs_embeds"]
            got["pos"] = kwargs["position_ids"]

        handle = lm.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            with torch.no_grad():
                t = torch.tensor([ids])
                kw = dict(input_ids=t, mm_token_type_ids=(t == mv.IMAGE_PAD).int())
                if pix is not None:
                    kw.update(pixel_values=pix, image_grid_thw=grids)
                o = model.model(**kw)
                logits = model.lm_head(o.last_hidden_state)
        finally:
            handle.remove()
        pos = got["pos"]
        if pos.shape[0] == 4:
            pos = pos[1:]
        return logits[0], o.last_hidden_state, got["embeds"], pos

    # The image prompts followed by the target's greedy tokens.
    images = []
    for k, (prompt, names) in enumerate(mv.PROMPTS):
        if not names:
            continue
        ids, pix, grids = mv.build_inputs(processor, os.path.join(src, "images"), prompt, names)
        full = list(ids)
        for _ in range(GREEDY):
            full.append(int(target(full, pix, grids)[0][-1].argmax()))
        images.append((k, names, ids, full, target(full, pix, grids)))

    # Trained on the target's greedy text continuations of random prompts, as `make` does, and on
    # the image prompts' continuations (so that their drafts are kept often enough to count).
    g = torch.Generator().manual_seed(81)
    seqs = []
    for _ in range(48):
        ids = torch.randint(0, cfg.vocab_size, (6,), generator=g).tolist()
        with torch.no_grad():
            for _ in range(26):
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        seqs.append(ids)
    ids = torch.tensor(seqs)
    with torch.no_grad():
        hidden = lm(input_ids=ids).last_hidden_state
        emb = embed(ids[:, 1:])
    ce = torch.nn.functional.cross_entropy
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    for _ in range(steps):
        logits = model.lm_head(head(emb, hidden[:, :-1]))[:, :-1]
        loss = ce(logits.reshape(-1, cfg.vocab_size), ids[:, 2:].reshape(-1))
        for _, _, _, full, (_, h, e, pos) in images:
            lg = model.lm_head(head(e[:, 1:], h[:, :-1], pos[:, :, :-1]))[0, :-1]
            loss = loss + ce(lg, torch.tensor(full[2:]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    head.eval()

    mdir = os.path.join(out, "model")
    model.save_pretrained(mdir)
    sd = load_file(os.path.join(mdir, "model.safetensors"))
    sd = {k: v.contiguous() for k, v in sd.items()}
    for k, v in head.state_dict().items():
        if not k.startswith("rotary."):
            sd["mtp." + k] = v.detach().contiguous()
    save_file(sd, os.path.join(mdir, "model.safetensors"), metadata={"format": "pt"})
    c = json.load(open(os.path.join(mdir, "config.json")))
    c["text_config"]["mtp_num_hidden_layers"] = 1
    c["text_config"]["mtp_use_dedicated_embeddings"] = False
    json.dump(c, open(os.path.join(mdir, "config.json"), "w"), indent=2)
    for f in os.listdir(os.path.join(src, "model")):
        if f not in ("model.safetensors", "config.json"):
            shutil.copy(os.path.join(src, "model", f), os.path.join(mdir, f))
    shutil.copytree(os.path.join(src, "images"), os.path.join(out, "images"))

    expected, stats = {}, {"train_loss": float(loss.detach()), "steps": steps, "prompts": []}
    for i, (k, names, ids, full, (_, h, e, pos)) in enumerate(images):
        with torch.no_grad():
            lg = model.lm_head(head(e[:, 1:], h[:, :-1], pos[:, :, :-1]))[0]
        drafts = lg.argmax(-1)
        image = torch.tensor(full) == mv.IMAGE_PAD
        expected[f"prompt.{i}"] = torch.tensor(ids, dtype=torch.int64)
        expected[f"greedy.{i}"] = torch.tensor(full[len(ids):], dtype=torch.int64)
        expected[f"drafts.{i}"] = drafts.to(torch.int64).contiguous()  # drafts[p] of x[p + 2]
        # Over prompt + greedy tokens: the target's rotary streams, its embeddings of the image
        # tokens (the tower's), its hidden states, and the head's logits.
        expected[f"positions.{i}"] = pos[:, 0].to(torch.int64).contiguous()
        expected[f"image_embeds.{i}"] = e[0][image].contiguous()
        expected[f"hidden.{i}"] = h[0].contiguous()
        expected[f"mtp_logits.{i}"] = lg.contiguous()
        hits = [int(drafts[q - 2]) == full[q] for q in range(len(ids), len(full))]
        stats["prompts"].append({"prompt": k, "images": names, "tokens": len(ids),
                                 "acceptance": sum(hits) / len(hits)})
    save_file(expected, os.path.join(out, "expected_mtp.safetensors"))
    json.dump(stats, open(os.path.join(out, "mtp_stats.json"), "w"), indent=2)
    print(json.dumps(stats))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--out", required=True)
    m.add_argument("--steps", type=int, default=400)
    ad = sub.add_parser("adapter")
    ad.add_argument("--fixture", required=True)
    md = sub.add_parser("medium")
    md.add_argument("--out", required=True)
    md.add_argument("--layers", type=int, default=12)
    md.add_argument("--steps", type=int, default=300)
    mmp = sub.add_parser("mm")
    mmp.add_argument("--out", required=True)
    mmp.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(2)
    if args.cmd == "make":
        make(args.out, args.steps)
    elif args.cmd == "adapter":
        adapter(args.fixture)
    elif args.cmd == "medium":
        medium(args.out, args.layers, args.steps)
    elif args.cmd == "mm":
        mm(args.out, args.steps)


if __name__ == "__main__":
    main()
