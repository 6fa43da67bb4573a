"""Models, placement and saving: where a model's tensors live and how a trained one is written, for every script.

  placement   prepare_frozen_model: a model that only runs forward (reference, reward model) on the device, kept
              on the CPU (--offload) or in a DeepSpeed ZeRO-3 inference engine; placed_on, place_frozen_models and
              zero3_offloaded_init: the frozen models of the PPO family brought to the device for one phase, or
              built inside ZeRO-3 with their partitions in CPU memory; whole_parameters: ZeRO-3 slices gathered for
              an in-place change; gathered_for_generation: the policy gathered once for a whole rollout or an
              evaluation's samples
  memory      checkpointed: --gradient_checkpointing on a model that trains
  saving      save_pretrained_model (safetensors, ZeRO-3 shards gathered, a full disk named), save_policy (the PPO
              family's policy out of its wrapper), merged_policy (a LoRA policy written as the plain model it
              computes), upload_to_hub; save_snapshot (the policy after an update, --save_policy_every and
              --save_policy_at, with the digest of its weights and the budget spent: weights_digest)
  ilql.py     save_ilql_model: the LM, its tokenizer, and its V, Q and target-Q heads beside them
  offline_rl.py
              push_offline_model: --push_to_hub, under its own default repository name

What it never does: build a model, choose its dtype, dropout, head or adapters, or change a weight a run trains
with. The scripts decide all of that; a placement here moves tensors and a save writes them, and tests check that
the saved model computes what the trained one did (merged_policy: tests/test_qlora.py).
"""

import contextlib
import copy
import hashlib
import json
import os
import sys
from typing import Callable, Optional

import torch
from safetensors.torch import save_file
from transformers.integrations import deepspeed_config, is_deepspeed_zero3_enabled

from rlhf_utils.run import saving


# ----------------------------------------------------------------------------------------------------------------------
# Placement: where the tensors of a frozen model live
# ----------------------------------------------------------------------------------------------------------------------
def prepare_frozen_model(accelerator, model: torch.nn.Module, offload: bool = False) -> torch.nn.Module:
    """Place a model that only runs forward (reference policy, reward model). Under ZeRO-3 from_pretrained has
    already partitioned its weights, so it runs in a DeepSpeed inference engine that gathers each layer for its
    forward; `offload` keeps the weights in CPU memory between uses (the paper's 6.9B setting, Detail 8).
    Elsewhere it moves to the device (or stays on the CPU for a script that moves it by hand on use)."""
    model.requires_grad_(False).eval()
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None or plugin.zero_stage != 3:
        return model.to("cpu" if offload else accelerator.device)
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": plugin.deepspeed_config["train_micro_batch_size_per_gpu"],
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu" if offload else "none"}},
        "bf16": {"enabled": plugin.deepspeed_config.get("bf16", {}).get("enabled") is True},
    }
    engine = deepspeed.initialize(model=model, config=config)[0]
    engine.eval()
    return engine.module


@contextlib.contextmanager
def placed_on(models, device: Optional[torch.device]):
    """--offload without ZeRO-3: the frozen models (None entries skipped) wait in CPU memory between phases and come
    to `device` once for a whole phase (a rollout, an evaluation), not around each chunk; device None (no --offload,
    no accelerator, or ZeRO-3, whose engine offloads by itself) leaves them where they are. The weights are copied to
    the device without blocking, from CPU memory pinned (page-locked) at the first move, which a GPU copies from
    asynchronously. Going back copies nothing: a frozen weight never changes, so each tensor is pointed at its pinned
    CPU copy again."""
    tensors = [t for m in models if m is not None for t in (*m.parameters(), *m.buffers())] if device else []
    kept = [t.data.pin_memory() if device.type == "cuda" and not t.data.is_pinned() else t.data for t in tensors]
    for tensor, cpu in zip(tensors, kept):
        tensor.data = cpu.to(device, non_blocking=True)
    try:
        yield
    finally:
        for tensor, cpu in zip(tensors, kept):
            tensor.data = cpu


def place_frozen_models(args, accelerator, reward_models, ref_policy, zero3: bool):
    """The reward model and the reference policy: placed on the device, kept on the CPU between uses (--offload),
    or under ZeRO-3 partitioned in a DeepSpeed inference engine that offloads them itself (Detail 8). Returns
    them and the device rollout() and eval_samples() bring them to for each phase (placed_on): the accelerator with
    --offload without ZeRO-3, else None (they stay where they are)."""
    device = accelerator.device
    reward_models = [prepare_frozen_model(accelerator, model, offload=args.offload) for model in reward_models]
    if args.num_layers_unfrozen >= 0:
        ref_policy.to(device)  # Hydra: the reference shares the policy's frozen trunk
    elif ref_policy is not None:
        ref_policy = prepare_frozen_model(accelerator, ref_policy, offload=args.offload)
    if args.offload and not zero3 and device.type == "cpu":
        accelerator.print("--offload: no accelerator present, models already live on CPU")
    return reward_models, ref_policy, device if args.offload and not zero3 and device.type != "cpu" else None


def zero3_offloaded_init(offload: bool):
    """--offload under ZeRO-3 (Detail 8): the frozen models are built inside DeepSpeed's ZeRO-3 Init with their
    partitions in pinned CPU memory (offload_param cpu), where their inference engine (prepare_frozen_model) keeps
    them, bringing each layer to the device for its forward. Without it, from_pretrained under the launch's
    zero3_init_flag partitions them onto the device, and the engine's offload setting would never apply (DeepSpeed
    offloads only the weights it partitions itself). from_pretrained's own Init runs inside this one, which decides
    where the partitions live; dtype and micro batch are the launch's config. Elsewhere a no-op."""
    if not (offload and is_deepspeed_zero3_enabled()):
        return contextlib.nullcontext()
    import deepspeed

    offloaded = {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}}
    return deepspeed.zero.Init(config_dict_or_path={**deepspeed_config(), "zero_optimization": offloaded})


def whole_parameters(params: list):
    """A context in which `params` (None entries skipped) are whole tensors that may be changed in place. Under
    ZeRO-3 (zero3.yaml) each process holds only a slice of each weight: the slices are gathered on entry and
    rank 0's values are sliced back out on exit (every rank computes the same change). Elsewhere it does nothing."""
    params = [p for p in params if p is not None]
    if not any(hasattr(p, "ds_id") for p in params):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=0)


def gathered_for_generation(model, on: bool):
    """--gather_for_generation: under ZeRO-3 each process holds a shard of every weight of `model` (the prepared
    engine), and a forward pass outside the engine (generate, and the rollout's scoring passes on the unwrapped model)
    all-gathers every layer on its way, at every decode step. In this context the whole model is gathered once on
    every process, the engine's per-layer fetch-and-release hooks are off, and on exit both are as before: DeepSpeed's
    own unwrap_model_for_generation (the idea of TRL's function of that name). The weights are the same, so are the
    sampled tokens and every log-probability; it needs the whole model's memory on each device (turn it off for a
    model too large for that). A no-op without ZeRO-3 (no engine, or another stage: the weights are whole)."""
    zero3 = on and getattr(model, "zero_optimization_stage", lambda: 0)() == 3  # (a DeepSpeed engine of ZeRO-3)
    # (deepspeed is loaded wherever a DeepSpeed engine exists)
    return sys.modules["deepspeed"].zero.unwrap_model_for_generation(model) if zero3 else contextlib.nullcontext()


def checkpointed(model, on: bool):
    """--gradient_checkpointing on a model that trains: transformers' activation checkpointing, non-reentrant
    (torch.utils.checkpoint with use_reentrant=False). The forward pass keeps only each decoder layer's input; the
    backward pass runs the layer again to get its activations, one more forward pass for the activation memory of all
    layers but one. The rerun repeats the same operations on the same inputs (dropout is off, Detail 7; with it on,
    torch restores the RNG state for the rerun), so the loss and gradients are those of a run without it. It applies
    only to a forward pass in training mode with gradients on: rollouts, references and evaluations are not rerun.
    transformers 5 names the method activation_checkpointing_enable (gradient_checkpointing_enable is its deprecated
    alias, the only name before 5); a peft (LoRA) model passes the call on to its transformers model. transformers 5
    also hooks the input embeddings so that their output requires grad, which reentrant checkpointing needs under
    frozen embeddings (LoRA); the non-reentrant kind passes gradients to the adapters without it."""
    if on:  # the method's name in transformers 5, else the name before 5 (in 5 a deprecated alias of it)
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)({"use_reentrant": False})
    return model


# ----------------------------------------------------------------------------------------------------------------------
# Saving: a trained model written as safetensors
# ----------------------------------------------------------------------------------------------------------------------
def save_pretrained_model(accelerator, wrapped, model, tokenizer, output_dir: str, prefix: str = "",
                          merge: Optional[Callable] = None) -> Optional[dict]:
    """save_pretrained (safetensors) of `model` and its tokenizer in output_dir. The weights are those of
    accelerator.get_state_dict(wrapped), which every process calls (ZeRO-3 gathers the shards); `prefix` is the
    name of `model` inside the wrapper (reward.py's "rm.", ppo.py's "policy."), dropped from the saved names.
    Returns that gathered state dict, whole, on the main process (ilql.py saves its heads from it), else None.

    `merge` (with LoRA: the script's merged_policy, which decides the saved numbers) saves merge(model) instead, the
    plain model that `model` computes; under ZeRO-3 every process takes part in gathering `model`'s partitioned
    weights first, and the main process merges and saves. A full disk is named either way."""
    accelerator.wait_for_everyone()
    then = "Free space there, then run again (--resume: from the newest checkpoint, if any)"
    if merge is not None:
        gathered = contextlib.nullcontext()
        if getattr(accelerator.state.deepspeed_plugin, "zero_stage", None) == 3:
            import deepspeed  # only under ZeRO-3

            gathered = deepspeed.zero.GatheredParameters(list(model.parameters()))
        with gathered:
            if accelerator.is_main_process:
                merged = merge(model)
                needed = sum(p.numel() * p.element_size() for p in merged.parameters())
                with saving(output_dir, "the final model", needed, then):
                    merged.save_pretrained(output_dir, safe_serialization=True)
                    tokenizer.save_pretrained(output_dir)
        return None
    state_dict = accelerator.get_state_dict(wrapped)
    if not accelerator.is_main_process:
        return None
    own = {name[len(prefix):]: value for name, value in state_dict.items() if name.startswith(prefix)}
    with saving(output_dir, "the final model", sum(v.numel() * v.element_size() for v in own.values()), then):
        model.save_pretrained(output_dir, state_dict=own)
        tokenizer.save_pretrained(output_dir)
    return state_dict


def save_policy(accelerator, model, tokenizer, path: str, lora: bool) -> None:
    """The policy (safetensors) and the tokenizer in `path` (save_pretrained_model: ZeRO-3 shards
    gathered, a full disk named); with LoRA the plain float32 model it computes (merged_policy: every adapter folded
    into its base layer, a 4-bit base dequantized first)."""
    policy = accelerator.unwrap_model(model).policy
    save_pretrained_model(accelerator, model, policy, tokenizer, path, prefix="policy.",
                          merge=merged_policy if lora else None)


def save_policy_snapshot(accelerator, model, tokenizer, output_dir: str, update: int, counters: dict,
                         lora: bool) -> None:
    """save_snapshot of the PPO family's policy, out of its wrapper (as save_policy)."""
    save_snapshot(accelerator, model, accelerator.unwrap_model(model).policy, tokenizer, output_dir, update, counters,
                  prefix="policy.", merge=merged_policy if lora else None)


def weights_digest(state_dict: dict) -> str:
    """The sha256 of a state dict: every tensor's name, dtype, shape and bytes, in name order. The frontier's
    evaluation (pipeline.py --mode frontier) digests each snapshot it loads and checks it against the one recorded
    when the snapshot was saved, so a point is never evaluated on another update's weights."""
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def snapshot_due(args, update: int, num_updates: int) -> bool:
    """Whether a policy snapshot is saved after `update`: a multiple of --save_policy_every (never the last update,
    which the final model covers), or an update --save_policy_at names (0: the starting policy)."""
    every = getattr(args, "save_policy_every", 0)
    return update in args.save_policy_at or (every > 0 and 0 < update < num_updates and update % every == 0)


def save_snapshot(accelerator, wrapped, model, tokenizer, output_dir: str, update: int, counters: dict,
                  prefix: str = "", merge: Optional[Callable] = None) -> None:
    """The policy after `update` (0: before the first) in {output_dir}/snapshots/update_N (save_pretrained_model,
    for evaluation; not resumable), and beside it snapshot.json: the update, the budget counters spent by then
    (`counters`) and the weights_digest of the weights as they were in memory (with LoRA: of the merged model as
    saved)."""
    path = os.path.join(output_dir, "snapshots", f"update_{update:06d}")
    state = save_pretrained_model(accelerator, wrapped, model, tokenizer, path, prefix, merge)
    if not accelerator.is_main_process:
        return
    if state is None:  # merged (LoRA): the digest of what was written
        from safetensors.torch import load_file

        state = {name: value for file in sorted(os.listdir(path)) if file.endswith(".safetensors")
                 for name, value in load_file(os.path.join(path, file)).items()}
    else:
        state = {name[len(prefix):]: value for name, value in state.items() if name.startswith(prefix)}
    record = {"update": update, "num_updates": counters.pop("num_updates"), "digest": weights_digest(state),
              "budget/updates": update, **counters}
    json.dump(record, open(os.path.join(path, "snapshot.json"), "w"), indent=1)


def merged_policy(policy) -> torch.nn.Module:
    """A LoRA policy (peft) as the plain transformers model it computes: every adapted layer's weight becomes
    W + delta, delta = peft's get_delta_weight (B A scaled by alpha / rank), in float32 and CPU memory, with no
    quantization config, so that the saved folder loads with a plain from_pretrained (judge.py, report.py, the next
    stage). A 4-bit base layer (QLoRA) is first dequantized to the very weights its forward used while the adapters
    trained. (peft's merge_and_unload would quantize W + delta back to 4 bits: a second rounding, which moves the
    merged model away from the one trained.) The policy itself is left as it is."""
    from accelerate import init_empty_weights
    from peft.tuners.lora import LoraLayer

    try:
        from bitsandbytes.functional import dequantize_4bit
        from bitsandbytes.nn import Linear4bit
    except ImportError:  # plain LoRA needs no bitsandbytes: none of its layers is 4-bit
        Linear4bit = ()

    def on_cpu(tensor: torch.Tensor) -> torch.Tensor:  # a float32 copy, never a view of the policy's tensors
        return tensor.detach().to("cpu", torch.float32, copy=True)

    def weight_of(layer) -> torch.Tensor:  # the weight a linear layer computes with
        if isinstance(layer, Linear4bit):
            return on_cpu(dequantize_4bit(layer.weight.data, layer.weight.quant_state))
        return on_cpu(layer.weight)

    model = policy.get_base_model()  # the transformers model, its linear layers wrapped by peft's LoRA layers
    adapted = {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    state = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if any(name.startswith(f"{outer}.") for outer in adapted):
            continue  # the inside of an adapted layer (its base layer and adapters), folded in below
        if name in adapted:
            base, weight = module.get_base_layer(), weight_of(module.get_base_layer())
            for adapter in module.active_adapters:
                if adapter not in module.merged_adapters:
                    weight = weight + on_cpu(module.get_delta_weight(adapter))  # W + delta
            state[prefix + "weight"] = weight
            if base.bias is not None:
                state[prefix + "bias"] = on_cpu(base.bias)
            continue
        for key, tensor in module.named_parameters(recurse=False):
            quantized = isinstance(module, Linear4bit) and key == "weight"
            state[prefix + key] = weight_of(module) if quantized else on_cpu(tensor)
        for key, tensor in module.named_buffers(recurse=False):
            state[prefix + key] = tensor.detach().to("cpu", copy=True)
    config = copy.deepcopy(model.config)
    config.__dict__.pop("quantization_config", None)  # a plain float32 model, like every other stage's
    with init_empty_weights():  # no random initialisation, nor a draw from the RNG: every weight comes from `state`
        plain = type(model)(config)
    missing = set(plain.state_dict()) - set(state)
    if missing:
        raise RuntimeError(f"merged_policy: no weights for {sorted(missing)[:5]} in {type(model).__name__}")
    plain.load_state_dict({key: state[key] for key in plain.state_dict()}, assign=True)
    plain.tie_weights()
    plain.generation_config = copy.deepcopy(model.generation_config)
    return plain.eval()


def upload_to_hub(args) -> None:
    """--push_to_hub: upload --output_dir (the model and its tokenizer) to the hub repository --hub_model_id
    (None: the run name). Main process only, after save_pretrained_model."""
    from huggingface_hub import HfApi  # only with --push_to_hub

    hub_model_id = args.run.hub_model_id if args.run.hub_model_id is not None else args.run.run_name
    api = HfApi()
    api.create_repo(hub_model_id, exist_ok=True)
    api.upload_folder(folder_path=args.output_dir, repo_id=hub_model_id)


# ----------------------------------------------------------------------------------------------------------------------
# offline_rl.py: the upload of its aligned model
# ----------------------------------------------------------------------------------------------------------------------
def push_offline_model(args) -> None:
    """offline_rl.py's --push_to_hub: upload --output_dir (--hub_model_id None ->
    f"{sft model name}__{exp_name}__{method}__{seed}"). Main process only, after save_pretrained_model."""
    from huggingface_hub import HfApi  # only with --push_to_hub

    hub_model_id = args.run.hub_model_id or (
        f"{os.path.basename(args.sft_model_path.rstrip('/'))}__{args.exp_name}__{args.method}__{args.seed}"
    )
    api = HfApi()
    api.create_repo(hub_model_id, exist_ok=True)
    api.upload_folder(folder_path=args.output_dir, repo_id=hub_model_id)


# ----------------------------------------------------------------------------------------------------------------------
# ilql.py: the LM and its ILQL heads
# ----------------------------------------------------------------------------------------------------------------------
def save_ilql_model(accelerator, model, tokenizer, args) -> None:
    """ilql.py's model: the LM (safetensors) and its tokenizer in --output_dir (save_pretrained_model: ZeRO-3 shards
    gathered, a full disk named), the V, Q and target-Q heads next to it in ilql_heads.safetensors with the sampling
    settings in ilql_heads.json."""
    unwrapped = accelerator.unwrap_model(model)
    state_dict = save_pretrained_model(accelerator, model, unwrapped.lm, tokenizer, args.output_dir, prefix="lm.")
    if not accelerator.is_main_process:
        return
    heads_state = {k[len("heads."):]: v.contiguous() for k, v in state_dict.items() if k.startswith("heads.")}
    with saving(args.output_dir, "the ILQL heads", sum(v.numel() * v.element_size() for v in heads_state.values()),
                "Free space there, then run again (--resume: from the newest checkpoint, if any)"):
        save_file(heads_state, os.path.join(args.output_dir, "ilql_heads.safetensors"))
        with open(os.path.join(args.output_dir, "ilql_heads.json"), "w") as f:
            json.dump({"hidden_size": unwrapped.lm.config.hidden_size, "two_qs": args.ilql.two_qs,
                       "beta": args.beta, "top_k": args.top_k, "temperature": args.eval_temperature}, f, indent=2)
