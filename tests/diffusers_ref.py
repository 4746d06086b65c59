"""diffusers 0.42.1 as the independent H3 reference (issue 40; docs/parity.md). Everything here is diffusers' own
code path: ``MiniMaxH3Transformer3DModel`` built from a core-named state dict by diffusers' single-file converter
(``convert_minimax_h3_transformer_checkpoint_to_diffusers``, [q; k; v] stacked rows, fc1 halves swapped), the
packed layout and per-row timesteps of its modular pipeline (``MiniMaxH3PrepareLayoutStep.build_packed_sequence``,
``MiniMaxH3SetTimestepsStep``), its latent packing (``MiniMaxH3PrepareLatentsStep``) and its denoise loop
(``MiniMaxH3DenoiseStep``: the transformer + ``MiniMaxH3Scheduler.step`` per modality). The pack's code is used only
to make the core-named weights it starts from (``h3_turbo.tools.fixtures``)."""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import torch


def _import_diffusers() -> None:
    """Import diffusers' H3 modules with this checkout's root off ``sys.path``: ``python -m pytest`` puts the
    current folder first, where the pack's ``kernels/`` would shadow the ``kernels`` distribution that diffusers'
    PEFT integration (through transformers) imports."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    mod = sys.modules.get("kernels")
    if mod is not None and os.path.abspath(getattr(mod, "__file__", "") or "").startswith(root + os.sep):
        raise RuntimeError("the pack's kernels/ was imported as the top-level 'kernels' module")
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    try:
        import diffusers.loaders.peft  # noqa: F401
        from diffusers import MiniMaxH3Scheduler, MiniMaxH3Transformer3DModel  # noqa: F401
    finally:
        sys.path[:] = saved


_import_diffusers()

#: diffusers' modality tags and audio packing (``MiniMaxH3ModularPipeline``: video 0, text 1, audio 2, stereo rows)
VIDEO_TAG, TEXT_TAG, AUDIO_TAG, AUDIO_CHANNELS = 0, 1, 2, 2
KEYFRAME_NOISE_AUG = 0.999


def diffusers_config(cfg) -> dict:
    """``MiniMaxH3Transformer3DModel`` arguments for the pack's tiny config (``tools.fixtures.TinyH3Config``)."""
    return dict(num_attention_heads=cfg.heads, attention_head_dim=cfg.head_dim, hidden_size=cfg.hidden,
                num_layers=cfg.num_layers, num_refiner_layers=cfg.refiner_layers, ffn_dim=cfg.ffn,
                in_channels=cfg.latents_dim, audio_in_channels=cfg.audio_latents_dim, patch_size=(1, 2, 2),
                text_dim=cfg.text_dim, freq_dim=cfg.timestep_input_dim, time_embed_hidden_dim=cfg.time_embed_hidden,
                time_embed_dim=cfg.time_embed_dim, rope_freq_dim=cfg.rope_len)


def model_from_core(sd_core: dict[str, torch.Tensor], cfg, dtype: torch.dtype = torch.bfloat16):
    """diffusers' model holding ``sd_core`` (core names), converted by diffusers' own single-file converter; the
    parameters outside ``_keep_in_fp32_modules`` (the FP32 island) in ``dtype`` (BF16 as the release; float32 for
    weights that are not BF16 values, e.g. dequantized NVFP4)."""
    from diffusers import MiniMaxH3Transformer3DModel
    from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers

    conf = diffusers_config(cfg)
    sd = convert_minimax_h3_transformer_checkpoint_to_diffusers({k: v.clone() for k, v in sd_core.items()}, conf)
    model = MiniMaxH3Transformer3DModel(**conf)
    keep = set(model._keep_in_fp32_modules)
    for name, p in model.named_parameters():          # parameters only: the rope buffer stays fp32, unrounded
        if name.split(".")[0] not in keep:
            p.data = p.data.to(dtype)
    model.load_state_dict(sd, strict=True)
    return model.eval()


def fp32(model):
    """A float32 copy (ComfyUI computes in fp32 on the CPU; the weights keep their BF16 values)."""
    import copy

    return copy.deepcopy(model).float()


def layout(text_len: int, latent_t: int, latent_h: int, latent_w: int, audio_t: int, anchors: tuple[str, ...] = ()):
    """diffusers' packed layout ``[text | keyframes | audio | video]``: dict of the transformer's layout inputs plus
    ``n_cond_video`` / ``n_cond_audio``."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep

    pos, tags, vid, aud, txt, ncv, nca = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        torch.full((text_len,), TEXT_TAG), latent_t, latent_h, latent_w, audio_t, (1, 2, 2), AUDIO_CHANNELS,
        AUDIO_TAG, VIDEO_TAG, anchors)
    return {"position_ids": pos, "token_tags": tags, "video_indices": vid, "audio_indices": aud, "text_indices": txt,
            "n_cond_video": ncv, "n_cond_audio": nca}


def rows(video_latent: torch.Tensor, audio_latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(video rows [T*h*w, C*4], audio rows [2*Ta, C]) by diffusers' ``MiniMaxH3PrepareLatentsStep`` from ComfyUI
    latents ([1, 24, T, H, W], [1, 32, 2, Ta]: diffusers' ``audio_latents`` is [1, 32, 2*Ta], channel-major)."""
    from diffusers.modular_pipelines import PipelineState
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLatentsStep

    comp = SimpleNamespace(_execution_device=torch.device("cpu"), patch_size=(1, 2, 2),
                           vae_latent_channels=video_latent.shape[1], audio_channels=AUDIO_CHANNELS,
                           audio_latent_channels=audio_latent.shape[1])
    st = PipelineState()
    a = audio_latent.reshape(1, audio_latent.shape[1], -1)
    for k, v in {"latents": video_latent.float(), "audio_latents": a.float(), "num_latent_frames": video_latent.shape[2],
                 "latent_height": video_latent.shape[3], "latent_width": video_latent.shape[4],
                 "num_audio_latents": audio_latent.shape[-1], "generator": None}.items():
        st.set(k, v)
    _, st = MiniMaxH3PrepareLatentsStep()(comp, st)
    return st.get("latents"), st.get("audio_latents")


def schedulers(steps: int, shift_video: float, shift_audio: float):
    """diffusers' two ``MiniMaxH3Scheduler`` (video, audio) with ``steps`` sigma points (terminal 0 included)."""
    from diffusers import MiniMaxH3Scheduler

    sv, sa = MiniMaxH3Scheduler(shift=shift_video), MiniMaxH3Scheduler(shift=shift_audio)
    sv.set_timesteps(steps)
    sa.set_timesteps(steps)
    return sv, sa


def plan(lay: dict, sched_v, sched_a) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """diffusers' per-step ``(timesteps, timestep_indices)`` (``MiniMaxH3SetTimestepsStep``)."""
    from diffusers.modular_pipelines import PipelineState
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep

    comp = SimpleNamespace(_execution_device=torch.device("cpu"), scheduler=sched_v, audio_scheduler=sched_a,
                           keyframe_noise_aug=KEYFRAME_NOISE_AUG)
    st = PipelineState()
    for k in ("video_indices", "audio_indices", "text_indices"):
        st.set(k, lay[k])
    st.set("num_inference_steps", len(sched_v.sigmas))
    st.set("num_condition_video_rows", lay["n_cond_video"])
    st.set("num_condition_audio_rows", lay["n_cond_audio"])
    _, st = MiniMaxH3SetTimestepsStep()(comp, st)
    return st.get("row_timestep_plan")


def forward(model, lay: dict, video_rows, audio_rows, context, timesteps, timestep_indices):
    """One transformer call -> (video velocity rows, audio velocity rows), data-ward (diffusers' sign)."""
    keys = ("position_ids", "token_tags", "video_indices", "audio_indices", "text_indices")
    with torch.no_grad():
        v, a = model(hidden_states=video_rows[None], audio_hidden_states=audio_rows[None], encoder_hidden_states=context,
                     timestep=timesteps, timestep_indices=timestep_indices, return_dict=False,
                     **{k: lay[k] for k in keys})
    return v[0], a[0]


def denoise(model, lay: dict, video_rows, audio_rows, context, steps: int, shift_video: float, shift_audio: float):
    """diffusers' own denoise loop (``MiniMaxH3DenoiseStep``: one forward + ``MiniMaxH3Scheduler.step`` per
    modality per step; conditioning rows are never written) from the given rows; returns the final rows."""
    from diffusers.modular_pipelines import PipelineState
    from diffusers.modular_pipelines.minimax_h3.denoise import MiniMaxH3DenoiseStep

    sv, sa = schedulers(steps, shift_video, shift_audio)
    comp = SimpleNamespace(_execution_device=torch.device("cpu"), transformer=model, scheduler=sv, audio_scheduler=sa)
    st = PipelineState()
    for k in ("position_ids", "token_tags", "video_indices", "audio_indices", "text_indices"):
        st.set(k, lay[k], "denoiser_input_fields")
    for k, v in {"timesteps": sv.timesteps, "audio_timesteps": sa.timesteps, "latents": video_rows.clone().float(),
                 "audio_latents": audio_rows.clone().float(), "prompt_embeds": context,
                 "row_timestep_plan": plan(lay, *schedulers(steps, shift_video, shift_audio)),
                 "num_condition_video_rows": lay["n_cond_video"],
                 "num_condition_audio_rows": lay["n_cond_audio"]}.items():
        st.set(k, v)
    blk = MiniMaxH3DenoiseStep()
    blk.set_progress_bar_config(disable=True)
    with torch.no_grad():
        _, st = blk(comp, st)
    return st.get("latents"), st.get("audio_latents")
