"""The driver of a distopt Ray job (:mod:`.__main__`): a package so the job can ship it.

Ray's job submission API ships extra code as directories (``runtime_env.py_modules``), so the
driver is this package, importable on the cluster as ``ray_job_driver``; it imports Ray and the
standard library only. Nothing is imported here: importing distopt never imports Ray.
"""
