# Source me: the variables tritonserver and its Python backend need on this machine.
_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_site="$("$_repo/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
export TRITON_HOME="$_site/pytriton/tritonserver"
# The stub links libpython: point it at the venv interpreter's, and make the venv importable.
export LD_LIBRARY_PATH="$("$_repo/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))'):$_site/nvidia_pytriton.libs:${LD_LIBRARY_PATH:-}"
export PYTHONPATH="$_repo:$_site${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$_repo/.venv/bin:$TRITON_HOME/bin:$PATH"
unset _repo _site
