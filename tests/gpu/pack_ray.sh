#!/usr/bin/env bash
# For a GPU machine that reaches no package index but has torch and Lightning (this workplace's
# device machines): packs Ray (its Java jars left out) and the dependencies such an image lacks
# into .whl/raysite.tar.xz, which tests/gpu/run.sh unpacks there. About 32 MB; build it on a
# machine with pip access:
#
#     bash tests/gpu/pack_ray.sh [python version, default 3.12]
set -euo pipefail
cd "$(dirname "$0")/../.."
version=${1:-3.12}
ray_version=$(python3 -c "import ray; print(ray.__version__)" 2>/dev/null || echo 2.60.0)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for requirement in "ray==$ray_version" jsonschema jsonschema-specifications referencing rpds-py; do
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$version" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$work/wheels" "$requirement"
done
mkdir -p "$work/site" .whl
for wheel in "$work"/wheels/*.whl; do
    python3 -m zipfile -e "$wheel" "$work/site"
done
rm -rf "$work/site/ray/jars"
# zipfile drops the executable bits that Ray's own binaries need
chmod +x "$work"/site/ray/core/src/ray/gcs/gcs_server "$work"/site/ray/core/src/ray/raylet/raylet
tar cJf .whl/raysite.tar.xz -C "$work/site" .
ls -l .whl/raysite.tar.xz
