# Sourced by tools/*-acceptance: the steps of one device call. The caller sets `steps` (" a b c ",
# the steps wanted), `limit` (seconds a step) and `logs` (a folder); `status` ends 1 when a step failed.
status=0
wanted() { [[ "$steps" == *" $1 "* ]]; }
step() {  # name, then the command (skipped unless the name is in $steps); its output into $logs/NAME.log
  local name=$1; shift
  wanted "$name" || return 0
  timeout "$limit" "$@" > "$logs/$name.log" 2>&1
  local rc=$?
  if [ $rc -ne 0 ]; then status=1; echo "== $name: failed (rc $rc; 124: timed out)"; fi
}
