#!/usr/bin/env bash
# pyckpt's outputs from an older build and from the installed one, compared byte for byte: a refactoring
# must leave every output as it was. BEFORE is a folder holding an older `pyckpt` package (e.g.
# `git archive <commit> pyckpt | tar -x -C BEFORE`, plus the native module where csrc/ is unchanged),
# imported ahead of the installed one through PYTHONPATH.
#
#   bash benchmarks/outputs_before_after.sh BEFORE CHECKPOINT WORK
#
# CHECKPOINT is a DeepSpeed save folder (holding `latest`); each job writes WORK/out with each build
# (the same path: a DCP export's save id is derived from it), moved to WORK/<job>-before and -after, and
# every file is compared. Exit status 1 names the first difference.
set -euo pipefail
before=$(realpath "$1"); ckpt=$(realpath "$2"); work=$3
python=${PYTHON:-python}
rm -rf "$work" && mkdir -p "$work" && work=$(realpath "$work")
cd "$work"  # `python -m` puts the current folder first on sys.path: not the source tree
run() {  # run <label> <output> <args...>
    local label=$1 out=$2; shift 2
    if [ "$label" = before ]; then PYTHONPATH="$before" "$python" -m pyckpt "$@" >/dev/null; else
        env -u PYTHONPATH "$python" -m pyckpt "$@" >/dev/null; fi
}
for job in convert hf dcp; do
    for label in before after; do
        out="$work/out"
        case $job in
            convert) run $label "$out" convert --quiet "$ckpt" "$out/u" ;;
            hf) run $label "$out" export --quiet --format hf "$ckpt" "$out/hf" ;;
            dcp) run $label "$out" export --quiet --format dcp "$ckpt" "$out/dcp" ;;
        esac
        mv "$out" "$work/$job-$label"
    done
    if ! diff -r --brief "$work/$job-before" "$work/$job-after"; then
        echo "$job: the outputs differ" >&2; exit 1
    fi
    files=$(find "$work/$job-after" -type f | wc -l); bytes=$(du -sb "$work/$job-after" | cut -f1)
    echo "$job: $files files, $bytes bytes, byte-equal before and after"
    rm -rf "$work/$job-before" "$work/$job-after"
done
