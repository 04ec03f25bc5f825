"""Make what check.py reads: each fixture checkpoint (tests/fixtures/lerobot_vla) imported into vlamux as a
tenant, trained two SFT steps (so the expert differs from the original), written back out with
`Policy.save_lerobot` to OUT/<family>/, and vlamux's own actions for the references' batch1 with its
fixed noise to OUT/<family>_vlamux_actions.safetensors.

Usage (from the repository root, in the project's venv): python scripts/lerobot_check/make_exports.py [OUT]
(default OUT: /tmp/lerobot_check). Then run check.py with lerobot itself (see README.md here).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import vlamux.policy
from vlamux.model.batch import Observation
from vlamux.model.group import ForwardBackward

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures" / "lerobot_vla"
VLM = {"smolvla": FIX / "assets" / "smolvlm2_tiny", "pi0": FIX / "assets" / "paligemma_tokenizer",
       "pi05": FIX / "assets" / "paligemma_tokenizer"}


def frames(ref: dict, batch: str) -> dict:
    return {cam: ref[f"{batch}.observation.images.{cam}.uint8_hwc"].permute(0, 3, 1, 2) for cam in ("front", "wrist")}


def main(out: Path) -> None:
    import json

    out.mkdir(parents=True, exist_ok=True)
    for family in ("smolvla", "pi0", "pi05"):
        ref = load_file(str(FIX / "references" / f"{family}.safetensors"))
        tasks = json.loads((FIX / "references" / f"{family}.json").read_text())["tasks"]
        policy = vlamux.policy.load(FIX / family, vlm=VLM[family])
        train = Observation(frames(ref, "train"), list(tasks["train"]), ref["train.observation.state"])
        for _ in range(2):
            policy.runner.execute([ForwardBackward("policy", train, ref["train.action"])])[0].unwrap()
            policy.runner.optim_step("policy").unwrap()
        obs = {"images": frames(ref, "batch1"), "instructions": tasks["batch1"],
               "state": ref["batch1.observation.state"].numpy()}
        act = torch.as_tensor(policy.act(obs, noise=ref["batch1.noise"]))
        policy.save_lerobot(out / family)
        save_file({"action": act.contiguous()}, str(out / f"{family}_vlamux_actions.safetensors"))
        print(f"{family}: wrote {out / family}; max |vlamux - original lerobot| = "
              f"{(act - ref['batch1.action']).abs().max():.3e} (the two SFT steps moved it)")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/lerobot_check"))
