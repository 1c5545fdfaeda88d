# shellcheck shell=bash
# The one .venv/ that scripts/quickstart.sh and scripts/test.sh share, sourced by both from the repository root:
#   source scripts/venv.sh && venv_install [EXTRA ...]        (e.g. test; none: the package alone)
# venv_install creates .venv/ where it is missing and installs the package (editable) with the extras asked for,
# only when needed. The stamp .venv/collab-vit.stamp holds the hash of pyproject.toml and the extras installed with it:
# - the same pyproject.toml, no new extra: nothing is installed, so a second run of either script uninstalls
#   nothing and never removes the other's entry points (collab-vit) while it runs;
# - a new extra: only its requirements (read from the installed package's metadata); the package is untouched;
# - another pyproject.toml (or no stamp, or no collab-vit entry point): the package again, with every extra so far.
venv_stamp=.venv/collab-vit.stamp
venv_pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

venv_extra_requirements() {  # the requirements of the extras given, one per line (none if the package is absent)
    .venv/bin/python - "$@" <<'EOF'
import importlib.metadata
import sys

try:
    requirements = importlib.metadata.requires("collab-vit") or []
except importlib.metadata.PackageNotFoundError:
    requirements = []
for requirement in requirements:
    name, _, marker = requirement.partition(";")
    if marker.replace("'", '"').strip() in {f'extra == "{extra}"' for extra in sys.argv[1:]}:
        print(name.strip())
EOF
}

venv_install() {  # venv_install [EXTRA ...]: see the top of this file
    local hash old_hash="" old_extras="" extras line new=() requirements=()
    [ -x .venv/bin/python ] || python3 -m venv .venv
    hash=$(.venv/bin/python -c 'import hashlib; print(hashlib.sha256(open("pyproject.toml", "rb").read()).hexdigest())')
    if [ -f "$venv_stamp" ]; then
        { read -r old_hash; read -r old_extras; } < "$venv_stamp" || true
    fi
    # shellcheck disable=SC2086  # the stamp's extras: one word each
    extras=$(printf '%s\n' $old_extras "$@" | sort -u | paste -sd, -)
    for extra in "$@"; do
        [[ ",${old_extras// /,}," == *",$extra,"* ]] || new+=("$extra")
    done
    if [ "$hash" != "$old_hash" ] || [ ! -e .venv/bin/collab-vit ]; then
        "${venv_pip[@]}" -e ".${extras:+[$extras]}"
    elif [ ${#new[@]} -gt 0 ]; then
        while IFS= read -r line; do requirements+=("$line"); done < <(venv_extra_requirements "${new[@]}")
        if [ ${#requirements[@]} -gt 0 ]; then
            "${venv_pip[@]}" "${requirements[@]}"
        else  # the metadata does not list them: the package again, with them
            "${venv_pip[@]}" -e ".[$extras]"
        fi
    else
        return 0
    fi
    printf '%s\n%s\n' "$hash" "${extras//,/ }" > "$venv_stamp"
}
