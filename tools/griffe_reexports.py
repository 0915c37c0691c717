"""Griffe extension for the API reference (mkdocs.yml): show re-exported names as public.

The frontends (``aiak_training.torch``, ``.tensorflow``, ``.keras``, ...) define little
themselves: like Horovod's modules, they import the user-facing functions from submodules
(``mpi_ops``, ``functions``, ``optimizer``...) and re-export them.  Griffe treats an imported
name as private unless the module lists it in ``__all__``, so the reference pages would come
out empty.  This marks every non-underscore name imported into the documented modules as
public; nothing about the code changes.

It also gives the reference the names that modules bind by unpacking a tuple
(``Average, Sum, ... = (int(op) for op in ReduceOp)``, ``init, shutdown = _ops.init, ...``),
which griffe's static analysis does not see.
"""
import ast
from typing import Any, Dict

import griffe

#: The modules whose imported names are their public API.
DOCUMENTED = ("aiak_training.torch", "aiak_training.tensorflow", "aiak_training.keras",
              "aiak_training.fused_optim", "aiak_training.dgc", "aiak_training.allreduce",
              "aiak_training.testing.cluster")


#: Modules that bind public names by tuple unpacking -> the docstring each such name gets.
UNPACKED: Dict[str, str] = {
    "aiak_training.common.dtypes": "Reduction op for the ``op=`` argument of the collectives, "
                                   "as Horovod's ``hvd.{name}``.",
    "aiak_training.keras": "Horovod's ``hvd.{name}``, taken from the frontend of the backend "
                           "Keras runs on (``aiak_training.tensorflow`` or "
                           "``aiak_training.torch``).",
}


def _add_unpacked(module: griffe.Module, doc: str) -> None:
    path = module.filepath
    if not isinstance(path, (str, bytes)) and not hasattr(path, "read_text"):
        return
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target = node.targets[0]
        if not isinstance(target, ast.Tuple):
            continue
        values = node.value.elts if isinstance(node.value, ast.Tuple) else None
        for i, elt in enumerate(target.elts):
            if not isinstance(elt, ast.Name) or elt.id.startswith("_") or elt.id in module.members:
                continue
            value = ast.unparse(values[i]) if values and len(values) == len(target.elts) else None
            attr = griffe.Attribute(elt.id, value=value, lineno=node.lineno,
                                    endlineno=node.end_lineno,
                                    docstring=griffe.Docstring(doc.format(name=elt.id)))
            module.set_member(elt.id, attr)


class ReExports(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        for path, doc in UNPACKED.items():
            try:
                module = loader.modules_collection.get_member(path)
            except (KeyError, ValueError):
                continue
            _add_unpacked(module, doc)
        for path in DOCUMENTED:
            try:
                module = loader.modules_collection.get_member(path)
            except (KeyError, ValueError):
                continue
            exports = set(module.exports or ())
            for name, member in module.members.items():
                if not member.is_alias or name.startswith("_"):
                    continue
                if exports and name not in exports:
                    continue
                if member.inherited:
                    continue
                member.public = True
