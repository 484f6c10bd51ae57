# Arms the worker tests' faults in the compile and check children of workers started with this folder on their
# PYTHONPATH (the fault and sandbox tests); every other process is left alone. See aotc_faultops.py.
import aotc_faultops

aotc_faultops.arm()
