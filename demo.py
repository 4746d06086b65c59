"""The main job: an H3 workflow through real ComfyUI, in-process, on the small embedded default model.

    python -m h3_turbo.demo [--workflow example_workflows/api/<name>.json] [--out DIR] [--models DIR]

1. finds ComfyUI (``$COMFYUI_PATH``, the ComfyUI this pack is installed in, or ``~/ComfyUI``);
2. writes the tiny H3 fixtures (BF16 + NVFP4 model, two Turbo LoRAs) into a models folder
   (``--models``, default a temporary folder);
3. runs the API-format workflow from ``example_workflows/api/`` through ComfyUI's own
   ``validate_prompt`` + ``PromptExecutor`` and prints each stage's time and the output paths.

The tiny model has no VAE (core builds the H3 VAEs at full size only), so the demo writes the AV
latent (video + audio ``.latent`` files) and a 24 fps latent-preview mp4. With the real files
(``--models`` pointing at a ComfyUI models tree with the H3 NVFP4 model, the Qwen3-VL text encoder and
both VAEs) run one of the real example workflows with ``--workflow`` to get an mp4 with 32 kHz
stereo audio.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_WORKFLOW = HERE / "example_workflows" / "api" / "h3turbo_tiny_demo.json"


def _stage(name: str, t0: float) -> float:
    t = time.perf_counter()
    print(f"[h3-turbo demo] {name}: {t - t0:.2f} s", flush=True)
    return t


def _provide_first_frames(prompt: dict) -> None:
    """For each ``LoadImage`` whose file is not in ComfyUI's input folder, write scikit-image's bundled
    ``astronaut`` photo (512x512 RGB) under that name, so the real FL2VA workflows run out of the box.
    Raises RuntimeError naming the file when scikit-image is not installed."""
    import folder_paths

    for nid, node in prompt.items():
        if node.get("class_type") != "LoadImage":
            continue
        name = node["inputs"].get("image")
        path = Path(folder_paths.get_input_directory()) / str(name)
        if path.exists():
            continue
        try:
            from PIL import Image
            from skimage import data
        except ImportError as e:
            raise RuntimeError(f"node {nid} (LoadImage) needs {path}; put a first-frame image there "
                               "(or install scikit-image for its bundled photo)") from e
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(data.astronaut()).save(path)
        print(f"[h3-turbo demo] first frame: scikit-image's bundled 'astronaut' photo -> {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m h3_turbo.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workflow", default=str(DEFAULT_WORKFLOW), help="API-format workflow JSON")
    ap.add_argument("--out", default=str(Path.cwd() / "h3turbo_demo_output"), help="output folder")
    ap.add_argument("--models", default=None, help="models folder (default: fresh tiny fixtures in a temp dir)")
    ap.add_argument("--comfyui", default=None, help="ComfyUI checkout (default: $COMFYUI_PATH, ~/ComfyUI)")
    ap.add_argument("--gpu", action="store_true", help="let ComfyUI use the GPU (default: --cpu)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    from .harness import ComfyUINotFound, PromptFailed, boot, find_comfyui

    t0 = time.perf_counter()
    try:
        path = find_comfyui(args.comfyui)
    except ComfyUINotFound as e:
        print(f"[h3-turbo demo] {e}", file=sys.stderr)
        return 2
    print(f"[h3-turbo demo] ComfyUI: {path}")

    tmp = None
    if args.models is None:
        from .tools.fixtures import make_fixtures

        tmp = tempfile.TemporaryDirectory(prefix="h3turbo_models_")
        models = tmp.name
        for name, p in make_fixtures(models).items():
            print(f"[h3-turbo demo]   fixture {name}: {p}")
        t = _stage("fixtures (tiny H3: 50+2 blocks, BF16 + NVFP4, two Turbo LoRAs)", t0)
    else:
        models = args.models
        if not os.path.isdir(models):
            print(f"[h3-turbo demo] --models {models}: not a folder (expected a ComfyUI models tree with "
                  "diffusion_models/, loras/, ...)", file=sys.stderr)
            return 2
        t = t0

    runner = boot(path, cpu=not args.gpu)
    runner.add_models_dir(models)
    out = Path(args.out).resolve()
    runner.set_output_dir(out)
    t = _stage("ComfyUI boot (built-in nodes + this pack)", t)

    wf_path = Path(args.workflow)
    try:
        prompt = json.loads(wf_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        print(f"[h3-turbo demo] cannot read workflow {wf_path}: {e}", file=sys.stderr)
        return 2
    print(f"[h3-turbo demo] workflow: {wf_path}")
    try:
        _provide_first_frames(prompt)
    except RuntimeError as e:
        print(f"[h3-turbo demo] {e}", file=sys.stderr)
        return 2
    try:
        outputs = runner.run(prompt)
    except PromptFailed as e:
        print(f"[h3-turbo demo] FAILED: {e}", file=sys.stderr)
        return 1
    for node_id, secs in runner.node_times():
        ct = prompt.get(node_id, {}).get("class_type", "?")
        title = prompt.get(node_id, {}).get("_meta", {}).get("title", ct)
        print(f"[h3-turbo demo]   node {node_id:>3} {title:<44} {secs:7.2f} s")
    t = _stage("workflow execution", t)

    files = []
    for node_out in outputs.values():
        for kind in ("images", "latents", "gifs", "videos", "audio"):
            for item in node_out.get(kind, []) or []:
                if isinstance(item, dict) and "filename" in item:
                    files.append(out / item.get("subfolder", "") / item["filename"])
    for f in files:
        print(f"[h3-turbo demo] output: {f} ({f.stat().st_size} bytes)" if f.exists() else f"[h3-turbo demo] output listed but missing: {f}")
    has_vae = any(ct.get("class_type") in ("VAEDecode", "VAEDecodeAudio") for ct in prompt.values())
    if not has_vae:
        print("[h3-turbo demo] no VAE in this workflow (tiny model): wrote the AV latent and a latent-preview "
              "video. For an mp4 with audio, use a real workflow with the real VAE files (README).")
    _stage("total", t0)
    if tmp is not None:
        tmp.cleanup()
    return 0 if files else 1


if __name__ == "__main__":
    sys.exit(main())
