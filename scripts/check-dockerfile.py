#!/usr/bin/env python3
"""Checks what this machine can check of the Dockerfile without a Docker
engine: each instruction of the `build` stage is replayed in a scratch
directory (COPY copies from the checkout; RUN runs with every `cargo build`
replaced by `cargo metadata --locked`), so a layer whose files cargo cannot
read as a workspace (a member's manifest missing, a stale lock) fails here.

    scripts/check-dockerfile.py [Dockerfile]
"""
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

repo = pathlib.Path(__file__).resolve().parent.parent
dockerfile = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else repo / "Dockerfile"

# Instructions, continuation lines joined, comments dropped.
text = re.sub(r"\\\n", " ", dockerfile.read_text())
instructions = [line.strip() for line in text.splitlines()
                if line.strip() and not line.strip().startswith("#")]

checked = 0
with tempfile.TemporaryDirectory() as scratch:
    scratch = pathlib.Path(scratch)
    in_build = False
    for instruction in instructions:
        keyword, _, args = instruction.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            in_build = re.search(r"\bAS\s+build\b", args, re.IGNORECASE) is not None
            continue
        if not in_build:
            continue
        if keyword == "COPY":
            parts = args.split()
            if any(p.startswith("--from") for p in parts):
                continue
            *sources, dest = [p for p in parts if not p.startswith("--")]
            for source in sources:
                origin = repo / source
                target = scratch / dest
                if origin.is_dir():
                    # Docker copies a directory's contents into `dest`.
                    shutil.copytree(origin, target, dirs_exist_ok=True)
                elif dest.endswith("/"):
                    target.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(origin, target / origin.name)
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(origin, target)
        elif keyword == "RUN":
            command = re.sub(r"cargo build[^&;]*", "cargo metadata --locked --format-version 1 >/dev/null ", args)
            print(f"check-dockerfile: RUN {command}", flush=True)
            subprocess.run(["bash", "-ec", command], cwd=scratch, check=True)
            checked += "cargo metadata" in command
if checked == 0:
    sys.exit("check-dockerfile: no cargo build found in the build stage")
print(f"check-dockerfile: {checked} cargo steps of the build stage resolve")
