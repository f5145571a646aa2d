#!/usr/bin/env bash
# The GPU check: tests/gpu/test_gpu.py against a real `pyserve run`, and its results as markdown.
# docs/gpu.md says what each check proves and how to run this on a lent GPU machine.
#
#   scripts/gpu_check.sh --download DIR   here, with PyPI: the wheels the GPU machine lacks
#   scripts/gpu_check.sh [--wheels DIR]   on the GPU machine: venv, install (offline from DIR), run
#   scripts/gpu_check.sh --cpu-only       any machine, current environment: no install, GPU checks skip
#   scripts/gpu_check.sh --download-triton DIR   here: nvidia-pytriton + numpy<2 (73 MB: two carries)
#
# Options: --out DIR (results; default ./gpu-check-out), --venv DIR (default /tmp/pyserve-gpu-venv),
# --python PY (the interpreter whose packages the venv sees; default python3, or .venv/bin/python
# with --cpu-only), --skip LIST (frameworks whose plugin and models are left out: torch,onnx),
# --timeout S (pytest, default 420),
# --triton-wheels DIR (install those wheels into --triton-venv for the optional Triton comparison),
# --triton-venv DIR (a venv with nvidia-pytriton and numpy<2; default /tmp/pyserve-gpu-triton),
# --dry-run (print the commands instead of running them).
# Exit status: 0 all checks passed or skipped, 1 a check failed, 2 bad usage or a failed install.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MODE=run WHEELS="" DOWNLOAD="" OUT="" VENV=/tmp/pyserve-gpu-venv PY="" SKIP="" TIMEOUT=420 DRY=0
TRITON_WHEELS="" TRITON_VENV=/tmp/pyserve-gpu-triton

# The GPU machine's Python (docs/gpu.md); numpy and the GPU stacks are its own, never carried.
PY_VERSION=3.12
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64)
# What the checks install beside the repository's own packages (pyproject.toml [project] deps).
TEST_REQUIREMENTS=("tritonclient[http,grpc]>=2.51" "pytest>=8" "pytest-timeout>=2.3" "httpx>=0.27" "setuptools>=77")
# Packages of the repository the checks serve with (editable installs).
PACKAGES=(. plugins/pyserve-backend-identity plugins/pyserve-backend-python
          plugins/pyserve-backend-onnxruntime plugins/pyserve-backend-pytorch)
CARRY_LIMIT_MB=58  # 64 MiB travel with the working tree: leave room for the repository

usage() { sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
die() { echo "gpu_check.sh: $*" >&2; exit 2; }
run() {  # run a command, or print it with --dry-run
    if [ "$DRY" = 1 ]; then printf '+'; printf ' %q' "$@"; printf '\n'; else "$@"; fi
}

while [ $# -gt 0 ]; do
    case "$1" in
        --download) [ $# -ge 2 ] || die "--download needs a directory"; MODE=download DOWNLOAD=$2; shift ;;
        --wheels) [ $# -ge 2 ] || die "--wheels needs a directory"; WHEELS=$2; shift ;;
        --download-triton) [ $# -ge 2 ] || die "--download-triton needs a directory"; MODE=download-triton DOWNLOAD=$2; shift ;;
        --triton-wheels) [ $# -ge 2 ] || die "--triton-wheels needs a directory"; TRITON_WHEELS=$2; shift ;;
        --triton-venv) [ $# -ge 2 ] || die "--triton-venv needs a directory"; TRITON_VENV=$2; shift ;;
        --cpu-only) MODE=cpu ;;
        --out) [ $# -ge 2 ] || die "--out needs a directory"; OUT=$2; shift ;;
        --venv) [ $# -ge 2 ] || die "--venv needs a directory"; VENV=$2; shift ;;
        --python) [ $# -ge 2 ] || die "--python needs an interpreter"; PY=$2; shift ;;
        --skip) [ $# -ge 2 ] || die "--skip needs a list (torch,onnx)"; SKIP=$2; shift ;;
        --timeout) [ $# -ge 2 ] || die "--timeout needs seconds"; TIMEOUT=$2; shift ;;
        --dry-run) DRY=1 ;;
        -h|--help) usage 0 ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
    shift
done
case "$TIMEOUT" in ''|*[!0-9]*) die "--timeout must be a number of seconds, got '$TIMEOUT'" ;; esac
for item in ${SKIP//,/ }; do
    case "$item" in torch|onnx) ;; *) die "--skip: unknown framework '$item' (torch, onnx)" ;; esac
done
if [ -n "$WHEELS" ] && [ "$DRY" = 0 ] && [ ! -d "$WHEELS" ]; then die "--wheels: '$WHEELS' is not a directory"; fi

# The repository's runtime requirements, read from pyproject.toml (numpy left out: the GPU
# machine's own numpy, which its torch and cupy are built against, must stay).
requirements() {
    "${PY:-python3}" - "$ROOT" <<'EOF'
import sys, tomllib
from pathlib import Path
root = Path(sys.argv[1])
seen = []
for requirement in tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]:
    name = requirement.split(";")[0].strip()
    if not name.startswith(("numpy", "pyserve")) and name not in seen:
        seen.append(name)
print("\n".join(seen))
EOF
}

if [ "$MODE" = download ]; then
    mapfile -t REQS < <(requirements)
    args=(-m pip download --only-binary=:all: --python-version "$PY_VERSION" --implementation cp
          --abi "cp${PY_VERSION/./}" --platform any -d "$DOWNLOAD")
    for platform in "${PLATFORMS[@]}"; do args+=(--platform "$platform"); done
    run mkdir -p "$DOWNLOAD"
    run "${PY:-python3}" "${args[@]}" "${REQS[@]}" "${TEST_REQUIREMENTS[@]}"
    # pip also fetched numpy for the others' requirements: the GPU machine has its own
    run find "$DOWNLOAD" -maxdepth 1 -name 'numpy-*.whl' -delete
    if [ "$DRY" = 0 ]; then
        size=$(du -sm "$DOWNLOAD" | cut -f1)
        echo "gpu_check.sh: $(ls "$DOWNLOAD" | wc -l) wheels, ${size} MB in $DOWNLOAD"
        if [ "$size" -gt "$CARRY_LIMIT_MB" ]; then
            echo "gpu_check.sh: over the ${CARRY_LIMIT_MB} MB that fit beside the repository in one carry" >&2
            exit 2
        fi
    fi
    exit 0
fi

if [ "$MODE" = download-triton ]; then
    # Triton 2.51 for the optional comparison; its Python-backend stub needs numpy < 2 beside it
    args=(-m pip download --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp
          --abi "cp${PY_VERSION/./}" --platform manylinux_2_35_x86_64 -d "$DOWNLOAD")
    for platform in "${PLATFORMS[@]}"; do args+=(--platform "$platform"); done
    run mkdir -p "$DOWNLOAD"
    run "${PY:-python3}" "${args[@]}" nvidia-pytriton==0.7.0 "numpy<2"
    exit 0
fi

OUT=${OUT:-$ROOT/gpu-check-out}
run mkdir -p "$OUT"

if [ "$MODE" = cpu ]; then
    # The current environment as it is (make install-test's .venv by default): nothing installed.
    if [ -z "$PY" ]; then
        if [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python; else PY=python3; fi
    fi
    RUN_PY=$PY
else
    # A venv that sees the packages of --python (the GPU machine's torch, cupy, onnxruntime,
    # pynvml, cuda-bindings) through a .pth file, with the repository and the rest installed in
    # it. Made without pip (the base interpreter may have no ensurepip): the base's pip runs in
    # it through the .pth (or with pip's --python), else the venv gets pip from ensurepip.
    BASE=${PY:-python3}
    RUN_PY=$VENV/bin/python
    log=$OUT/install.log
    if [ "$DRY" = 0 ]; then : >"$log"; fi
    run "$BASE" -m venv --clear --without-pip "$VENV"
    if [ "$DRY" = 0 ]; then
        site=$("$RUN_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        "$BASE" -c 'import sys
for p in sys.path:
    if p.endswith(("site-packages", "dist-packages")):
        print(f"import site; site.addsitedir({p!r})")' >"$site/_gpu_check_base.pth"
        if "$RUN_PY" -m pip --version >>"$log" 2>&1; then  # the base's pip, seen through the .pth
            pip=("$RUN_PY" -m pip)
        elif "$BASE" -m pip --python "$RUN_PY" --version >>"$log" 2>&1; then
            pip=("$BASE" -m pip --python "$RUN_PY")
        elif "$RUN_PY" -m ensurepip >>"$log" 2>&1; then
            pip=("$RUN_PY" -m pip)
        else
            tail -n 20 "$log" >&2
            die "no pip for $VENV: $BASE's pip has no --python and ensurepip failed (log: $log)"
        fi
    else
        echo "+ (write the site dirs of $BASE into $VENV/lib/python*/site-packages/_gpu_check_base.pth)"
        pip=("$RUN_PY" -m pip)
    fi
    pip+=(install --disable-pip-version-check --no-input)
    if [ -n "$WHEELS" ]; then pip+=(--no-index --find-links "$WHEELS"); fi
    editable=()
    for package in "${PACKAGES[@]}"; do
        case ",$SKIP," in  # --skip torch: no pytorch plugin (it needs torch); --skip onnx likewise
            *,torch,*) [ "$package" = plugins/pyserve-backend-pytorch ] && continue ;;
        esac
        case ",$SKIP," in *,onnx,*) [ "$package" = plugins/pyserve-backend-onnxruntime ] && continue ;; esac
        editable+=(-e "$ROOT/$package")
    done
    echo "gpu_check.sh: installing into $VENV (log: $log)"
    if [ "$DRY" = 1 ]; then
        run "${pip[@]}" "setuptools>=77"
        run "${pip[@]}" --no-build-isolation "${editable[@]}" "${TEST_REQUIREMENTS[@]}"
    elif ! { "${pip[@]}" "setuptools>=77" && "${pip[@]}" --no-build-isolation "${editable[@]}" \
                "${TEST_REQUIREMENTS[@]}"; } >>"$log" 2>&1; then
        tail -n 30 "$log" >&2
        die "install failed (full log: $log)"
    fi
fi

if [ -n "$TRITON_WHEELS" ]; then
    # Only pytriton and numpy<2, into a venv of their own (benchmarks/_triton.py finds them in its
    # site-packages); the base's pip installs them there with --target, --no-deps.
    run "${PY:-python3}" -m venv --clear --without-pip "$TRITON_VENV"
    triton_site='$TRITON_SITE'
    if [ "$DRY" = 0 ]; then
        triton_site=$("$TRITON_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    fi
    triton_pip=("${PY:-python3}" -m pip install --no-index --no-deps --no-input --disable-pip-version-check
                --upgrade --target "$triton_site" "$TRITON_WHEELS"/*.whl)
    if [ "$DRY" = 1 ]; then
        run "${triton_pip[@]}"
    elif ! "${triton_pip[@]}" >>"$OUT/install.log" 2>&1; then
        echo "gpu_check.sh: installing the Triton wheels failed (log: $OUT/install.log); its comparison will skip" >&2
    fi
fi

# The checks: tests/gpu/test_gpu.py and the framework plugins' own GPU tests (in-process servers).
# -W default: a library's deprecation warning must not fail a check; -o timeout: a test's first
# server start imports torch, onnxruntime and cupy.
TESTS=(tests/gpu/test_gpu.py)
case ",$SKIP," in *,onnx,*) ;; *)
    TESTS+=(plugins/pyserve-backend-onnxruntime/tests/test_onnxruntime_backend.py::test_gpu_instance_uses_cuda_provider) ;;
esac
case ",$SKIP," in *,torch,*) ;; *)
    TESTS+=(plugins/pyserve-backend-pytorch/tests/test_pytorch_backend.py::test_gpu_instance_runs_on_cuda
            plugins/pyserve-backend-pytorch/tests/test_pytorch_backend.py::test_gpu_instance_forward_runs_with_its_device_current) ;;
esac
status=0
export PYSERVE_GPU_CHECK=1 PYSERVE_GPU_CHECK_SKIP=$SKIP PYSERVE_GPU_CHECK_OUT=$OUT PYTHONUNBUFFERED=1
export PYSERVE_GPU_TRITON_VENV=$TRITON_VENV
if [ "$MODE" = cpu ]; then export PYSERVE_GPU_CHECK_CPU_ONLY=1; else unset PYSERVE_GPU_CHECK_CPU_ONLY; fi
cd "$ROOT"
if [ "$DRY" = 1 ]; then
    run timeout "$TIMEOUT" "$RUN_PY" -m pytest "${TESTS[@]}" -q -rA -W default -o timeout=300 --junitxml "$OUT/gpu-junit.xml"
    run "$RUN_PY" scripts/gpu_report.py "$OUT/gpu-junit.xml"
    exit 0
fi
set +e
timeout "$TIMEOUT" "$RUN_PY" -m pytest "${TESTS[@]}" -q -rA -W default -o timeout=300 \
    --junitxml "$OUT/gpu-junit.xml" >"$OUT/gpu-pytest.log" 2>&1
status=$?
set -e
tail -n 40 "$OUT/gpu-pytest.log"
if [ "$status" = 124 ]; then echo "gpu_check.sh: pytest ran past --timeout $TIMEOUT s" >&2; fi
if ! "$RUN_PY" scripts/gpu_report.py "$OUT/gpu-junit.xml" >"$OUT/gpu-report.md"; then
    echo "gpu_check.sh: no report (see $OUT/gpu-pytest.log)" >&2
    exit 2
fi
echo
cat "$OUT/gpu-report.md"
case "$status" in
    0) exit 0 ;;
    1) exit 1 ;;
    *) echo "gpu_check.sh: pytest exited with status $status (see $OUT/gpu-pytest.log)" >&2; exit 2 ;;
esac
