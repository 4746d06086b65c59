"""The main job: an H3 workflow through the real ComfyUI, in-process (no server), on the small embedded
default model. ``python -m h3_turbo.demo --help`` prints :data:`HELP`."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_WORKFLOW = HERE / "example_workflows" / "api" / "h3turbo_tiny_demo.json"

HELP = """\
Run an H3 workflow through the real ComfyUI in this process (no web server), on the CPU unless --gpu.

Without --models: writes the tiny H3 fixtures (a 50 + 2 block H3 in BF16 and NVFP4, two Turbo LoRAs) into a
temporary folder, runs example_workflows/api/h3turbo_tiny_demo.json on them through ComfyUI's own validation
and executor, prints each stage's time and the output files, and deletes the fixtures again. The tiny model
has no VAE (core builds the H3 VAEs at full size only): the outputs are the video and audio latents
(.latent) and a 24 fps latent-preview mp4, in OUT/h3turbo/.

With --models DIR: uses the ComfyUI models tree DIR as it is and writes nothing into it. Run a real example
workflow on the real files there (the H3 model, the Qwen3-VL text encoder, both VAEs, the Turbo LoRA) for an
mp4 with 32 kHz stereo audio:
  python -m h3_turbo.demo --models /path/to/ComfyUI/models --gpu \\
      --workflow example_workflows/api/h3turbo_fl2va_turbo_4step_nvfp4.json

To keep the tiny fixtures (for a live ComfyUI server), write them with
  python -m h3_turbo.tools make-fixtures DIR
(README, "Serve the tiny demo").

ComfyUI: --comfyui DIR (used as it is: exit 2 if DIR is not a ComfyUI with H3), else $COMFYUI_PATH (a wrong one
is logged as a warning), else the ComfyUI this pack is installed in, else ~/ComfyUI.
Exit status: 0 done; 1 the workflow failed (ComfyUI's error is printed); 2 a setup problem (no ComfyUI,
an unreadable or UI-format workflow, --models not a folder, no first-frame image)."""


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


def _failure(e) -> str:
    """A failed run in words: ComfyUI's validation errors per node, or the node that raised and its message."""
    from .client import format_execution_error

    if e.node_errors is None and isinstance(e.error, dict) and e.error.get("node_id") is not None:
        return format_execution_error(e.error)
    return str(e)


def _no_traceback_for_pack_errors(record: logging.LogRecord) -> bool:
    """Logging filter: drop the traceback core's executor logs (``Traceback (most recent call last)...``, inside its
    ``except``) when the exception being handled is one of the pack's own errors, whose message already names the
    file, the key and what was expected; every other record passes."""
    from .errors import H3TurboError

    exc = sys.exc_info()[1]
    return not (isinstance(exc, H3TurboError) and str(record.msg).startswith("Traceback (most recent call last)"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m h3_turbo.demo", description=HELP,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workflow", default=str(DEFAULT_WORKFLOW),
                    help="API-format workflow JSON (default: the tiny demo)")
    ap.add_argument("--out", default=str(Path.cwd() / "h3turbo_demo_output"),
                    help="output folder (default: ./h3turbo_demo_output)")
    ap.add_argument("--models", default=None, metavar="DIR",
                    help="a ComfyUI models tree to use as it is (default: tiny fixtures in a temporary folder)")
    ap.add_argument("--comfyui", default=None, metavar="DIR",
                    help="ComfyUI checkout (default: $COMFYUI_PATH, the ComfyUI the pack is in, ~/ComfyUI)")
    ap.add_argument("--gpu", action="store_true", help="let ComfyUI use the GPU (default: CPU only)")
    ap.add_argument("--traceback", action="store_true",
                    help="keep core's Python traceback for the pack's own errors (default: their one-line message)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not args.traceback:      # core's executor logs through the root logger: its filter sees those records
        logging.getLogger().addFilter(_no_traceback_for_pack_errors)

    from .harness import ComfyUINotFound, PromptFailed, boot, find_comfyui

    t0 = time.perf_counter()
    try:
        path = find_comfyui(args.comfyui)
    except ComfyUINotFound as e:
        print(f"[h3-turbo demo] {e}", file=sys.stderr)
        return 2
    print(f"[h3-turbo demo] ComfyUI: {path}")
    # the workflow is read before the fixtures and ComfyUI's boot: a wrong path fails at once
    wf_path = Path(args.workflow)
    from .client import ClientError, load_workflow

    try:
        prompt = load_workflow(wf_path)    # refuses UI-format files, naming their api/ twin
    except ClientError as e:
        print(f"[h3-turbo demo] {e}", file=sys.stderr)
        return 2
    print(f"[h3-turbo demo] workflow: {wf_path}")

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

    try:
        _provide_first_frames(prompt)
    except RuntimeError as e:
        print(f"[h3-turbo demo] {e}", file=sys.stderr)
        return 2
    try:
        outputs = runner.run(prompt)
    except PromptFailed as e:
        print(f"[h3-turbo demo] FAILED: {_failure(e)}", file=sys.stderr)
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
