# Sourced by .ci/run, tests/run.sh and tests/sanitize.sh: `stage NAME` ends the
# stage before it (printing its wall time) and starts NAME; `stage` alone ends
# the last. Each ended stage is also appended to $FUSEDMHA_STAGE_LOG when set,
# so .ci/run can print every stage's time, its scripts' included, at the end.
_stage_name=""
_stage_start=$SECONDS
stage() {
  if [ -n "$_stage_name" ]; then
    local line
    line=$(printf '%-28s %5d s' "$_stage_name" $((SECONDS - _stage_start)))
    echo "== done: $line"
    [ -z "${FUSEDMHA_STAGE_LOG:-}" ] || echo "$line" >> "$FUSEDMHA_STAGE_LOG"
  fi
  _stage_name="${1:-}"
  _stage_start=$SECONDS
  [ -z "$_stage_name" ] || echo "== $_stage_name ($(date +%T)) =="
}
