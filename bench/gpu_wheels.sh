#!/usr/bin/env bash
# The wheels a lent GPU machine needs for bench/gpu_check.sh, fetched here into .whl/ (its image has torch,
# Lightning, transformers, pytest and hypothesis, not Ray): Ray 2.60 for CPython 3.12, slimmed under the 64 MiB a
# call carries (its jars, RLlib, Serve, LLM and the dashboard's web build removed, from the files and the RECORD),
# jsonschema and what it needs, and pydantic and what it needs (ray.train.v2, so Result.checkpoint).
#
#   bash bench/gpu_wheels.sh          # then, on the machine (carry .whl):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && OUT=$OUT bash bench/gpu_check.sh
set -euo pipefail
dest=.whl
mkdir -p "$dest"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dest" \
  ray==2.60.0 jsonschema jsonschema-specifications referencing rpds-py \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing_extensions==4.16.0 typing-inspection==0.4.5
wheel=$(ls "$dest"/ray-2.60.0-cp312-*.whl)
cut='^ray/(jars|rllib|serve|llm|dashboard/client/build)/'
if unzip -Z1 "$wheel" | grep -E "$cut" > /dev/null; then
  zip -q -d "$wheel" 'ray/jars/*' 'ray/rllib/*' 'ray/serve/*' 'ray/llm/*' 'ray/dashboard/client/build/*'
  tmp=$(mktemp -d)
  mkdir -p "$tmp/ray-2.60.0.dist-info"
  unzip -p "$wheel" ray-2.60.0.dist-info/RECORD | grep -vE "$cut" > "$tmp/ray-2.60.0.dist-info/RECORD"
  wheel=$(realpath "$wheel")
  (cd "$tmp" && zip -q "$wheel" ray-2.60.0.dist-info/RECORD)
  rm -rf "$tmp"
fi
du -sh "$dest"
