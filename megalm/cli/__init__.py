"""The command-line tools, one module per command, each with ``main(argv=None) -> int`` (the exit
status).  pyproject.toml installs them as console scripts; ``python tools/<tool>.py`` runs the
same ``main`` through a thin shim.

==========================  =====================================  ===========================
console script              module                                 script
==========================  =====================================  ===========================
``megalm-preprocess``       :mod:`megalm.cli.preprocess_data`      tools/preprocess_data.py
``megalm-merge-datasets``   :mod:`megalm.cli.merge_datasets`       tools/merge_datasets.py
``megalm-train-tokenizer``  :mod:`megalm.cli.train_tokenizer`      tools/train_tokenizer.py
``megalm-convert``          :mod:`megalm.cli.convert`              tools/checkpoint/convert.py
``megalm-inspect``          :mod:`megalm.cli.inspect_checkpoint`   tools/checkpoint/inspect.py
``megalm-generate``         :mod:`megalm.cli.generate`             tools/generate.py
``megalm-estimate``         :mod:`megalm.cli.estimate`             tools/estimate.py
``megalm-cluster``          :mod:`megalm.cli.cluster`              tools/cluster/run.py
``megalm-plan``             :mod:`megalm.cli.plan`                 tools/plan.py
``megalm-presets``          :mod:`megalm.presets.cli`              tools/presets.py
==========================  =====================================  ===========================
"""

# console script -> "module:function" (pyproject.toml's [project.scripts] lists the same; a test checks it).
COMMANDS = {
    "megalm-preprocess": "megalm.cli.preprocess_data:main",
    "megalm-merge-datasets": "megalm.cli.merge_datasets:main",
    "megalm-train-tokenizer": "megalm.cli.train_tokenizer:main",
    "megalm-convert": "megalm.cli.convert:main",
    "megalm-inspect": "megalm.cli.inspect_checkpoint:main",
    "megalm-generate": "megalm.cli.generate:main",
    "megalm-estimate": "megalm.cli.estimate:main",
    "megalm-cluster": "megalm.cli.cluster:main",
    "megalm-plan": "megalm.cli.plan:main",
    "megalm-presets": "megalm.presets.cli:main",
}
