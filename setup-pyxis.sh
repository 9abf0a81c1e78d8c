#!/usr/bin/env bash
# Build the training image from the Dockerfile with docker or podman, then
# turn it into the Enroot squashfs file that Pyxis runs (CONTAINER_IMAGE).
#
#   ./setup-pyxis.sh [EXTRA BUILD FLAGS...]   e.g. --build-arg CUDA_ARCHS="9.0;10.0"
#
# Settings (scripts/launch_common.sh, docs/LAUNCHERS.md): CONTAINER_IMAGE,
# CONTAINER_ENGINE, IMAGE_TAG, BASE_IMAGE, DRY_RUN.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
source scripts/launch_common.sh

engine=$CONTAINER_ENGINE
for candidate in docker podman; do
    if [[ -z $engine ]] && command -v "$candidate" >/dev/null 2>&1; then
        engine=$candidate
    fi
done
# DRY_RUN=1 prints the commands even where the tools are missing (with docker).
if [[ $DRY_RUN == 1 ]]; then
    engine=${engine:-docker}
else
    [[ -n $engine ]] || die "neither docker nor podman found: install one, or set CONTAINER_ENGINE to its name"
    need_cmd "$engine" "install it, or set CONTAINER_ENGINE to docker or podman"
    need_cmd enroot "install Enroot (github.com/NVIDIA/enroot) here to convert the image for Pyxis"
    "$engine" info >/dev/null 2>&1 \
        || die "$engine info fails: start the $engine service or get permission to use it (CONTAINER_ENGINE=$engine)"
fi
case $engine in
    docker) source_uri=dockerd://$IMAGE_TAG ;;
    podman) source_uri=podman://$IMAGE_TAG ;;
    *) die "CONTAINER_ENGINE=$engine: use docker or podman" ;;
esac
[[ $CONTAINER_IMAGE == *.sqsh ]] || die "CONTAINER_IMAGE=$CONTAINER_IMAGE: name the output file, ending in .sqsh"

build=("$engine" build --tag "$IMAGE_TAG" ${BASE_IMAGE:+--build-arg BASE_IMAGE="$BASE_IMAGE"} "$@" .)
partial=$CONTAINER_IMAGE.partial
import=(enroot import --output "$partial" "$source_uri")

run_cmd "${build[@]}"
[[ $DRY_RUN == 1 ]] || rm -f "$partial"
run_cmd "${import[@]}"
run_cmd mv -f "$partial" "$CONTAINER_IMAGE"
[[ $DRY_RUN == 1 ]] || log "image ready: $CONTAINER_IMAGE (train-pyxis.sbatch and train-pyxis-singlenode.sh use it)"
