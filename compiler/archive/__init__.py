"""Static checks of an uploaded `torch.export.save` archive: no torch, no unpickling, nothing evaluated.

An upload meets three layers of defence, each enough on its own for the attacks it covers:

    API, at upload       this package: the zip's layout, names and sizes and the JSON's size, depth and value
                         count (container), pickles against an allow-list of what torch.save writes (pickles),
                         expression strings, guards and tree specs against whitelist grammars (exprs), the JSON
                         walked with a table of torch's export schema, every field checked or refused (schema,
                         program), every callable the program names against the operator list and what each
                         allowed higher-order op calls (ops, ops.txt), every other graph string against the
                         grammar of where it sits, since codegen pastes strings into source (strings), the
                         program's ints, inputs and weights against their files (program); every bound a named
                         setting (limits); tied together by inspect.inspect_archive
    worker, before load  the same checks again (the worker does not trust that the API looked), then every
                         pickled entry through torch.load(weights_only=True) (compiler.loading); after the load,
                         every callable of every loaded graph checked against the same list, free-text node
                         metadata dropped and graph strings checked again
    worker, during load  torch.export.load inside compiler.compat.safe_load.guarded_export_load: weights_only
                         forced, pickle.loads / torchbind / AOTInductor loading refused, each expression
                         string re-checked, each operator name checked before torch looks it up, no metadata read

Nothing here imports torch: the API imports this package, and the API process never imports torch.
"""

from compiler.archive.inspect import inspect_archive

__all__ = ["inspect_archive"]
