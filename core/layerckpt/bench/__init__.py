"""Benchmarks, demo models and workloads: ``layerckpt bench``, the examples and the tests use them.

Nothing in the engine imports this package.  ``run`` is the ``layerckpt bench``
command, ``cases`` its contenders, ``models`` a GPT-2-shaped model, ``workload``
the examples' pre-train/fine-tune task, ``lightning_workload`` its
LightningModule (imports lightning), ``family`` the workload family on which
the selection defaults are measured.
"""
