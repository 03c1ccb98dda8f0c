# ci/lib.sh: what the nightly scripts share; sourced by ci/nightly.sh, ci/gpu.sh and
# ci/vllm_nightly.sh, never run. Each script's header comment is its --help text.
# shellcheck shell=bash disable=SC2034  # opt, run_extra and rc are read by the scripts that source this

ci_name="ci/$(basename "$0")"
usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "$ci_name: $*" >&2; exit 2; }
is_num() { [[ $1 =~ ^[0-9]+([.][0-9]+)?$ ]]; }

# parse_args "OWN..." "PASS..." "$@": every option takes a value. `--name V` for a name in
# OWN sets opt[name]=V (set defaults in opt before calling); for a name in PASS it is added to
# run_extra, for `llmfuzz run`. Anything else is bad input (exit 2, one line).
declare -A opt=()
run_extra=()
parse_args() {
    local own=" $1 " pass=" $2 " name
    shift 2
    while (($#)); do
        case $1 in
            -h|--help) usage; exit 0 ;;
        esac
        name=${1#--}
        if [[ $1 == --* && ($own == *" $name "* || $pass == *" $name "*) ]]; then
            (($# >= 2)) || die "$1 needs a value"
            if [[ $own == *" $name "* ]]; then opt[$name]=$2; else run_extra+=("$1" "$2"); fi
            shift 2
        else
            die "unknown argument '$1' (see --help)"
        fi
    done
}

# Sets $PYTHON to the interpreter llmfuzz runs under (its shebang), so reports and checks
# see the same packages as the campaign; a $PYTHON already set wins.
llmfuzz_python() {
    command -v llmfuzz >/dev/null || die "llmfuzz is not installed (pip install -e '.[test]' first)"
    if [[ -z ${PYTHON:-} ]]; then
        local shebang
        shebang=$(head -n1 "$(command -v llmfuzz)")
        PYTHON=${shebang#\#!}
        [[ -x $PYTHON ]] || PYTHON=python3
    fi
}

# is_json FILE: the file holds one JSON document (a summary that llmfuzz finished writing).
is_json() { "${PYTHON:-python3}" -c 'import json,sys; json.load(open(sys.argv[1]))' "$1" 2>/dev/null; }

# Run a command in the background and forward SIGINT/SIGTERM to it, so a CI time limit
# reaches llmfuzz (which then prints its summary so far) and the script still writes its
# report. Sets $rc to the command's exit code.
rc=0
forwarding() {
    "$@" &
    local child=$!
    trap 'kill -INT "$child" 2>/dev/null' INT
    trap 'kill -TERM "$child" 2>/dev/null' TERM
    wait "$child"; rc=$?
    while kill -0 "$child" 2>/dev/null; do wait "$child"; rc=$?; done
    trap - INT TERM
}
