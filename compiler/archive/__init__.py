"""Static checks of an uploaded `torch.export.save` archive: no torch, no unpickling, nothing evaluated.

An upload meets three layers of defence, each enough on its own for the attacks it covers:

    API, at upload       this package: the zip's names and sizes (container), pickles against an allow-list of
                         what torch.save writes (pickles), expression strings, guards and tree specs against
                         whitelist grammars (exprs), the program's node targets and inputs (program), tied
                         together by inspect.inspect_archive
    worker, before load  the same checks again (the worker does not trust that the API looked), then every
                         pickled entry through torch.load(weights_only=True) (compiler.loading)
    worker, during load  torch.export.load inside compiler.compat.safe_load.guarded_export_load: weights_only
                         forced, pickle.loads / torchbind / AOTInductor loading refused, each expression
                         string re-checked

Nothing here imports torch: the API imports this package, and the API process never imports torch.
"""

from compiler.archive.inspect import inspect_archive

__all__ = ["inspect_archive"]
