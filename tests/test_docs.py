"""Every module of fp4compile has a docstring, and so does every public function, class and method.

Public: the names in a module's ``__all__`` (else its names without a leading underscore) that are functions
or classes defined in that module (not imported into it), and the methods without a leading underscore
defined in such a class's body (plain, static and class methods, and properties). ``inspect.getdoc`` is the
test, so a method overriding a documented base-class method (e.g. ``nn.Module.forward``) inherits its doc.

Every module is imported: one that fails to import on this machine fails the test (no skipping).
"""
import functools
import importlib
import inspect
import pkgutil

import fp4compile


def _raise(name):
    raise  # pkgutil calls this inside its ``except ImportError``: re-raise it instead of skipping the package


def package_modules(package=fp4compile):
    """The package and every module under it, imported."""
    names = [package.__name__] + [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".",
                                                                         onerror=_raise)]
    return [importlib.import_module(n) for n in names]


def _function(obj):
    """The plain function behind ``obj`` (a function, or a ``functools.wraps``/``lru_cache`` wrapper), else None."""
    try:
        fn = inspect.unwrap(obj)
    except ValueError:                      # a wrapper cycle
        return None
    return fn if inspect.isfunction(fn) else None


def _member_function(attr):
    """The function of a class-body attribute (a method, possibly decorated, a static/class method or a property
    getter), else None. Decorators are not unwrapped here: ``inspect.getdoc`` finds a base-class method's doc
    only through the attribute the class really holds."""
    if isinstance(attr, (staticmethod, classmethod)):
        attr = attr.__func__
    elif isinstance(attr, property):
        attr = attr.fget
    elif isinstance(attr, functools.cached_property):
        attr = attr.func
    return attr if attr is not None and _function(attr) is not None else None


def public_objects(mod):
    """``(qualified name, object)`` of the public functions and classes defined in ``mod`` and of their
    public methods (the object whose ``inspect.getdoc`` is checked)."""
    names = getattr(mod, "__all__", None)
    if names is None:
        names = [n for n in vars(mod) if not n.startswith("_")]
    out = []
    for name in names:
        obj = getattr(mod, name)          # a name in __all__ that does not exist fails here, loudly
        if not (inspect.isclass(obj) or _function(obj) is not None):
            continue
        if getattr(obj, "__module__", None) != mod.__name__:
            continue                      # imported from elsewhere: checked where it is defined
        out.append((f"{mod.__name__}.{name}", obj))
        if inspect.isclass(obj):
            for attr_name, attr in vars(obj).items():
                fn = None if attr_name.startswith("_") else _member_function(attr)
                if fn is not None:
                    out.append((f"{mod.__name__}.{name}.{attr_name}", fn))
    return out


def undocumented(modules):
    """Names of the modules (marked ``(module)``) and public objects of ``modules`` without a docstring."""
    missing = []
    for mod in modules:
        if not inspect.getdoc(mod):
            missing.append(f"{mod.__name__} (module)")
        missing += [name for name, obj in public_objects(mod) if not inspect.getdoc(obj)]
    return missing


def _toy_module():
    """A module with one undocumented thing of every kind the walk must find, and things it must skip."""
    import types

    mod = types.ModuleType("toy")          # no module docstring

    def undocumented():
        pass

    @functools.lru_cache(maxsize=None)
    def cached():
        pass

    class Toy:
        """Documented."""

        def method(self):
            pass

        @staticmethod
        def static():
            pass

        @classmethod
        def klass(cls):
            pass

        @property
        def prop(self):
            pass

        def documented(self):
            """Documented."""

        def _private(self):
            pass

    def _private():
        pass

    for obj in (undocumented, cached, Toy, _private):
        obj.__module__ = "toy"
    mod.undocumented, mod.cached, mod.Toy, mod._private = undocumented, cached, Toy, _private
    mod.imported = inspect.getdoc          # defined elsewhere: not this module's to document
    return mod


def test_checker_flags_every_kind_of_missing_docstring():
    assert sorted(undocumented([_toy_module()])) == [
        "toy (module)", "toy.Toy.klass", "toy.Toy.method", "toy.Toy.prop", "toy.Toy.static", "toy.cached",
        "toy.undocumented"]
    mod = _toy_module()
    mod.__all__ = ["Toy"]                   # __all__, when present, is the list of public names
    assert sorted(undocumented([mod])) == ["toy (module)", "toy.Toy.klass", "toy.Toy.method", "toy.Toy.prop",
                                           "toy.Toy.static"]


def test_checker_on_the_package(monkeypatch):
    mods = package_modules()
    names = {m.__name__ for m in mods}
    # a broken walk (wrong prefix, skipped subpackages) must not pass vacuously
    assert {"fp4compile", "fp4compile.policy", "fp4compile.passes", "fp4compile.passes.linear",
            "fp4compile.train.loop", "fp4compile.optim.codec", "fp4compile.nn.lora_svd",
            "fp4compile.kernels.attention_ref"} <= names
    from fp4compile import policy

    monkeypatch.setattr(policy.Rule.matches, "__doc__", None)
    monkeypatch.setattr(policy.NVFP4.name.fget, "__doc__", None)
    assert {"fp4compile.policy.Rule.matches", "fp4compile.policy.NVFP4.name"} <= set(undocumented(mods))


def test_every_public_object_has_a_docstring():
    missing = undocumented(package_modules())
    assert not missing, f"{len(missing)} public names without a docstring:\n  " + "\n  ".join(missing)
