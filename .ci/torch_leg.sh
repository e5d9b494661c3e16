#!/usr/bin/env bash
# CI leg: pipesplit on one more torch release (argument: an exact version, e.g. 2.10.0), in a fresh
# virtualenv: that torch from the package index, the project with its test extras, the demo, and
# the tests marked torch_matrix (the list is tests/conftest.py's TORCH_MATRIX).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${1:?usage: .ci/torch_leg.sh TORCH_VERSION (e.g. 2.10.0)}"
say() { echo "ci[torch $VERSION]: $*"; }
started=$SECONDS

VENV=".venv-ci-torch-$VERSION"
rm -rf "$VENV"
python3 -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"

# pip's configuration here may carry a constraint file capping torch (global.constraint). The
# PIP_CONSTRAINT variable replaces the configured file for this leg's installs only, with one that
# pins torch to the release asked for, so installing the project cannot swap torch either.
PIN="$PWD/$VENV/torch-pin.txt"  # absolute: pip runs from other folders too (test_packaging)
echo "torch==$VERSION" >"$PIN"
export PIP_CONSTRAINT="$PIN"

check_torch() {
    local got
    got=$(python3 -c "import torch; print(torch.__version__)")
    if [ "${got%%+*}" != "$VERSION" ]; then
        say "FAILED: asked for torch $VERSION, the virtualenv has torch $got ($1)"
        exit 1
    fi
    say "torch $got ($1)"
}

say "installing torch==$VERSION from the package index (the CUDA build: about 3 GB)"
python3 -m pip install -q "torch==$VERSION"
check_torch "installed"
python3 -m pip install -q -e ".[test]"
check_torch "after installing pipesplit with its test extras"
say "installed in $((SECONDS - started)) s"

python3 -c "import pipesplit, torch; print('ci[torch $VERSION]: import pipesplit', pipesplit.__version__, 'on torch', torch.__version__)"
DEMO=$(mktemp -d)
pipesplit demo --out "$DEMO" --bench gpipe
rm -rf "$DEMO"

say "pytest -m torch_matrix"
python3 -m pytest -q -m torch_matrix
say "passed in $((SECONDS - started)) s"
deactivate
rm -rf "$VENV"  # several GB of CUDA libraries
