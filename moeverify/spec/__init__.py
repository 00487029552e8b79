"""What to run, declared once and torch-free (the CLI, ``--help`` and ``run --list`` import only this side).

- ``checks``: the built-in checks (name, entry point, subcheck names, typed options, scenario rule);
  ``options``: their options as one flat table (CLI flags, scenario keys, docs);
- ``bug_classes``: what each subcheck exists for, a public example, and what proves the catch;
- ``scenario``: scenario files in, validated ``Scenario`` values out (``yaml_file``: YAML with line numbers);
- ``expectations``: expected failures (known findings) marked in scenario files;
- ``layout``: parallel layouts and their rules; ``router_variants``: the router settings replay runs over;
- ``timeouts``: every wait, declared once; ``plugins``: ``module:attr`` / ``file.py:attr`` user code;
- ``support``: the package versions supported;
- ``models``: model references, the tiny families' configs and the traits checks read (no torch).

An import contract forbids torch, Megatron, transformers and safetensors here; the few function-local
exceptions (a ``pp_layout`` parser, a user model's config class) are listed in ``pyproject.toml``.
"""
