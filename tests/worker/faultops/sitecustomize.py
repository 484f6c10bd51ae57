# Registers the fault-test custom ops in every Python process started with this folder on PYTHONPATH
# (the fault tests' workers and their compile children). See aotc_faultops.py.
import aotc_faultops  # noqa: F401
