"""Run a script (or ``-m module``) against the jax_tq installed in SITE (``pip install --target SITE``)
rather than the editable install: ``python3 scripts/with_site.py SITE script.py args...`` or
``python3 scripts/with_site.py SITE -m pytest args...``. gpu_run.sh's ab stage times several
source trees built side by side this way."""
import os
import runpy
import sys

# The editable install's finder (scikit-build-core) would answer `import jax_tq` first.
sys.meta_path[:] = [f for f in sys.meta_path if "ScikitBuild" not in type(f).__name__]
sys.path.insert(0, os.path.abspath(sys.argv[1]))
if sys.argv[2] == "-m":
    module = sys.argv[3]
    sys.argv = [module] + sys.argv[4:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
else:
    script = os.path.abspath(sys.argv[2])
    sys.argv = sys.argv[2:]
    sys.path.insert(0, os.path.dirname(script))
    runpy.run_path(script, run_name="__main__")
