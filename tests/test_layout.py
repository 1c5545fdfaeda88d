"""The package's layers import one way only: checks <- layers <- weights_io <- console <- conversion <- models
(models_rope) <- hub <- training <- cli; inside conversion/, a conversion's stages: weights <- calibration <- reparam
<- files."""
import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / 'collab_vit'
RANK = {'_version': -1, 'checks': -0.5, 'layers': 0, 'weights_io': 1, 'console': 1.5, 'conversion': 2, 'models': 3,
        'models_rope': 3, 'hub': 3.5, 'training': 4, 'cli': 5, '__init__': 6}

STAGE_RANK = {'weights': 0, 'calibration': 1, 'reparam': 2, 'files': 3, '__init__': 4}  # inside conversion/


def part(module: str) -> str:
    """'collab_vit.conversion.reparam' -> 'conversion'."""
    return module.split('.')[1] if module.count('.') else '__init__'


def module_name(path: Path) -> str:
    """collab_vit/training/build.py -> 'collab_vit.training.build'; a package's __init__.py -> the package."""
    parts = path.relative_to(PACKAGE.parent).with_suffix('').parts
    return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob('*.py')}


def imports(path: Path) -> set:
    """The package's modules ``path`` imports: every ``import`` and ``from ... import`` anywhere in it (under ``if
    TYPE_CHECKING:`` and inside functions too), relative ones resolved; ``from M import n`` names the submodule
    ``M.n`` where there is one, else ``M``."""
    name = module_name(path)
    package = name if path.name == '__init__.py' else name.rpartition('.')[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split('.')[:len(package.split('.')) - node.level + 1] if node.level else []
            module = '.'.join(base + ([node.module] if node.module else []))
            found |= {f'{module}.{a.name}' if f'{module}.{a.name}' in MODULES else module for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m in MODULES}


def stage(module: str) -> str:
    """'collab_vit.conversion.weights.fit' -> 'weights', 'collab_vit.conversion.reparam' -> 'reparam',
    'collab_vit.conversion' -> '__init__'."""
    return module.split('.')[2] if module.count('.') > 1 else '__init__'


def against_ranks(edges: dict, rank: dict, kind) -> list:
    """'a imports b' for each edge of ``edges`` (module -> modules it imports) where ``b``'s rank is above ``a``'s
    (``rank[kind(module)]``)."""
    return [f'{a} imports {b}' for a, targets in sorted(edges.items()) for b in sorted(targets)
            if rank[kind(b)] > rank[kind(a)]]


def test_imports_go_one_way():
    wrong = against_ranks({name: imports(path) for name, path in MODULES.items()}, RANK, part)
    assert not wrong, wrong


CONVERSION = {name: path for name, path in MODULES.items() if part(name) == 'conversion'}


def test_conversion_stages_import_one_way():
    """weights (no images) <- calibration (what reads images) <- reparam (the public entries) <- files (the command
    line's side): each stage imports only from its own and those below it."""
    assert {stage(name) for name in CONVERSION} == set(STAGE_RANK)
    edges = {name: {m for m in imports(path) if part(m) == 'conversion'} for name, path in CONVERSION.items()}
    wrong = against_ranks(edges, STAGE_RANK, stage)
    assert not wrong, wrong


def test_against_ranks_names_the_wrong_edge():
    edges = {'p.conversion.weights.fit': {'p.conversion.calibration.recipe', 'p.conversion.weights.decompose'},
             'p.conversion.files.commands': {'p.conversion.reparam'}}
    wrong = 'p.conversion.weights.fit imports p.conversion.calibration.recipe'
    assert against_ranks(edges, STAGE_RANK, stage) == [wrong]


def find_cycle(edges: dict) -> list:
    """One cycle of the graph ``edges`` (module -> modules it imports) as [a, b, ..., a], or [] when there is none."""
    state, stack = {}, []  # state: 1 while on the stack, 2 when done

    def visit(node: str) -> list:
        state[node] = 1
        stack.append(node)
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                return stack[stack.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        state[node] = 2
        stack.pop()
        return []

    for node in sorted(edges):
        cycle = [] if node in state else visit(node)
        if cycle:
            return cycle
    return []


def test_find_cycle_names_the_cycle():
    assert find_cycle({'a': {'b'}, 'b': {'c'}, 'c': {'a'}, 'd': {'a'}}) == ['a', 'b', 'c', 'a']
    assert find_cycle({'a': {'b', 'c'}, 'b': {'c'}, 'c': set()}) == []


def test_no_import_cycle():
    """No module of the package imports, directly or through others, one that imports it back (``TYPE_CHECKING``
    and function-level imports count: they tie the modules all the same)."""
    cycle = find_cycle({name: imports(path) - {name} for name, path in MODULES.items()})
    assert not cycle, 'import cycle: ' + ' -> '.join(cycle)


@pytest.mark.parametrize('package', ['training', 'conversion/weights', 'conversion/calibration', 'conversion/files'])
def test_package_lists_its_modules_top_to_bottom(package):
    """The package's __init__.py imports nothing and names every module of the package, each importing only those
    it lists below it."""
    init = PACKAGE / package / '__init__.py'
    tree = ast.parse(init.read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    listed = re.findall(r'^\* ``(\w+)``', ast.get_docstring(tree), re.M)
    assert sorted(listed) == sorted(p.stem for p in init.parent.glob('*.py') if p.stem != '__init__')
    prefix = 'collab_vit.' + package.replace('/', '.') + '.'
    for i, name in enumerate(listed):
        inside = {m.rpartition('.')[2] for m in imports(init.parent / f'{name}.py') if m.startswith(prefix)}
        assert inside <= set(listed[i + 1:]), f'{package}/{name}.py imports {sorted(inside - set(listed[i + 1:]))}'


def test_version_agrees_with_pyproject():
    import tomllib

    import collab_vit
    pyproject = tomllib.loads((PACKAGE.parent / 'pyproject.toml').read_text())
    assert pyproject['project']['version'] == collab_vit.__version__


def test_license_file_matches_pyproject():
    """The repository ships the license text pyproject declares (Apache-2.0)."""
    import tomllib

    pyproject = tomllib.loads((PACKAGE.parent / 'pyproject.toml').read_text())
    assert pyproject['project']['license'] == {'text': 'Apache-2.0'}
    text = (PACKAGE.parent / 'LICENSE').read_text()
    assert 'Apache License' in text and 'Version 2.0, January 2004' in text and 'END OF TERMS AND CONDITIONS' in text
