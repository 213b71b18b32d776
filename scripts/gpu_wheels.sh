#!/usr/bin/env bash
# Wheels for scripts/gpu_check.sh, downloaded here (where pip reaches a registry) into .whl/ (git-ignored
# through .git/info/exclude), for the GPU host's Python 3.12; the versions are those of this .venv.
set -euo pipefail
py=${PY:-.venv/bin/python}
version() { "$py" -c "import importlib.metadata as m; print(m.version('$1'))"; }
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
wanted=()
for name in pydantic pydantic_core typing-inspection annotated-types megatron-core math-verify latex2sympy2_extended \
            antlr4-python3-runtime hjson datasets dill multiprocess; do
    wanted+=("$name==$(version "$name")")
done
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d .whl "${wanted[@]}"
# DeepSpeed ships as source: a pure-Python wheel, its ops compiled on first use there (nvcc is installed).
(cd /tmp && DS_BUILD_OPS=0 "$OLDPWD/$py" -m pip wheel -q --no-deps --no-build-isolation -w "$OLDPWD/.whl" \
    "deepspeed==$(cd "$OLDPWD" && version deepspeed)")
du -sh .whl
