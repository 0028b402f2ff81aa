# The environment every GPU check runs in. Sourced (by bench/gpu_all.sh, bench/gpu_steps.sh and
# tests/scripts/gpu_inputs_check.sh), not run; sourcing it again changes nothing.
#
#   cd to the repository root; PY = the interpreter (python3 unless set: the GPU image's python3 is
#   the one with its CUDA torch);
#   gpu_env 1   on the GPU machine: install the wheels carried in .whl/ (bench/gpu_wheels.sh) once
#               into $WHEEL_SITE (/tmp/site) and put them on PYTHONPATH, ahead of the image's copies;
#   gpu_env 0   anywhere else (the CPU smoke run): no wheels (they are built for the GPU image's Python);
#   both: PYTHONPATH starts with this checkout's src/ and keeps what it had (so the carried wheels
#   stay visible: a bare PYTHONPATH=src would drop them), HF_HUB_OFFLINE=1 (no downloads there),
#   PYTHONUNBUFFERED=1 (logs appear as they happen), TOKENIZERS_PARALLELISM=false.
GPU_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$GPU_ROOT" || return 2
PY=${PY:-python3}
WHEEL_SITE=${WHEEL_SITE:-/tmp/site}

_gpu_prepend() {  # _gpu_prepend DIR PATHLIST: DIR first, once
  case ":$2:" in *":$1:"*) echo "$2" ;; *) echo "$1${2:+:$2}" ;; esac
}

IMAGE_FIRST=(tensorboard)
# Carried but installed only where the image lacks them: the image's tensorboard matches its protobuf
# and grpcio (tensorboard 2.21 wants protobuf >= 6.31). Every other carried wheel is installed, so the
# GPU runs use the versions the CPU suite is tested with (peft) or that the image lacks.

gpu_install_wheels() {  # prints what it did; returns pip's status
  local whl dist chosen=() kept=()
  for whl in .whl/*.whl; do
    [ -f "$whl" ] || continue
    dist=$(basename "$whl" | cut -d- -f1 | tr 'A-Z-' 'a-z_')
    if [[ " ${IMAGE_FIRST[*]} " == *" $dist "* ]] &&
       env -u PYTHONPATH "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$dist') is None)" 2>/dev/null; then
      kept+=("$dist")
    else
      chosen+=("$whl")
    fi
  done
  [ ${#kept[@]} = 0 ] || echo "wheels: kept the image's own ${kept[*]}"
  if [ ${#chosen[@]} = 0 ]; then
    echo "wheels: none to install (.whl/ empty or absent; bench/gpu_wheels.sh fetches them)"
    return 0
  fi
  if [ -f "$WHEEL_SITE/.ndparallel-wheels" ] && [ "$(cat "$WHEEL_SITE/.ndparallel-wheels")" = "${chosen[*]}" ]; then
    echo "wheels: already installed in $WHEEL_SITE"
    return 0
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WHEEL_SITE" \
    "${chosen[@]}" || { echo "wheels: pip install FAILED"; return 1; }
  echo "${chosen[*]}" >"$WHEEL_SITE/.ndparallel-wheels"
  echo "wheels: installed into $WHEEL_SITE: ${chosen[*]#.whl/}"
}

gpu_env() {  # gpu_env 1|0: with or without the carried wheels
  local path=${PYTHONPATH:-}
  if [ "${1:-0}" = 1 ]; then
    gpu_install_wheels
    path=$(_gpu_prepend "$WHEEL_SITE" "$path")
  fi
  PYTHONPATH=$(_gpu_prepend "$GPU_ROOT/src" "$path")
  export PYTHONPATH PY HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
}
