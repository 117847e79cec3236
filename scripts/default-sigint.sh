# Sourced first by serve.sh and docker-entrypoint.sh. Started in the background by a
# non-interactive shell (`scripts/serve.sh &` in a script), bash inherits SIGINT ignored and cannot
# trap a signal ignored at its start: `kill -INT` did nothing (QA). The script then starts again
# with SIGINT at its default (coreutils' env, as client/local_server.py starts tritonserver).
ignored=$(awk '/^SigIgn:/ {print $2}' /proc/$$/status 2>/dev/null) || true
if (( 0x${ignored:-0} & 2 )) && env --default-signal=INT true 2>/dev/null; then
  exec env --default-signal=INT "$BASH" "$0" "$@"
fi
unset ignored
