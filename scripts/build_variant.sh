#!/usr/bin/env bash
# Builds the cubins of an experiment patch into a folder for scripts/ab_cubins.sh, on this (CPU)
# machine: a throw-away worktree of HEAD, the patch applied, `python -m mok_rt.build --only STEM`
# for each STEM, then STEM's cubin and the manifest copied to OUT_DIR.  The worktree is removed
# afterwards; nothing in this checkout changes.
#     bash scripts/build_variant.sh bench/experiments/combine_after_down_wgrads.patch .carry/cadw moe_backward_fp8
# The baseline for the A/B is this checkout's own cubins:  mkdir -p .carry/base && cp mok_rt/cubins/* .carry/base/
set -euo pipefail
patch=$(realpath "$1"); dst=$(realpath -m "$2"); shift 2
[ $# -ge 1 ] || { echo "usage: $0 PATCH OUT_DIR STEM..." >&2; exit 2; }
cd "$(dirname "$0")/.."
wt=$(mktemp -d /tmp/variant.XXXXXX)
trap 'git worktree remove --force "$wt" >/dev/null 2>&1 || true' EXIT
git worktree add -q --detach "$wt" HEAD
git -C "$wt" apply "$patch"
args=(); for s in "$@"; do args+=(--only "$s"); done
(cd "$wt" && python -m mok_rt.build "${args[@]}" -v)
mkdir -p "$dst"
for s in "$@"; do cp "$wt"/mok_rt/cubins/"$s".*.cubin "$dst"/; done
cp "$wt"/mok_rt/cubins/manifest.json "$dst"/
ls -l "$dst"
