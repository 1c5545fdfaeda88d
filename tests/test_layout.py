"""The package's layers import one way only: layers <- weights_io <- conversion <- models (models_rope) <- hub <- training <- cli."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / 'collab_vit'
RANK = {'_version': -1, 'layers': 0, 'weights_io': 1, 'conversion': 2, 'models': 3, 'models_rope': 3, 'hub': 3.5, 'training': 4, 'cli': 5,
        '__init__': 6}


def part(module: str) -> str:
    """'collab_vit.conversion.reparam' -> 'conversion'."""
    return module.split('.')[1] if module.count('.') else '__init__'


def imports(path: Path) -> set:
    name = '.'.join(path.relative_to(PACKAGE.parent).with_suffix('').parts)
    package = name if path.name == '__init__.py' else name.rpartition('.')[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split('.')[:len(package.split('.')) - node.level + 1]
                module = '.'.join(base + ([node.module] if node.module else []))
                found |= {f'{module}.{a.name}' if not node.module else module for a in node.names}
            elif node.module and node.module.startswith('collab_vit'):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith('collab_vit')}
    return {m for m in found if m.startswith('collab_vit.')}


def test_imports_go_one_way():
    wrong = []
    for path in PACKAGE.rglob('*.py'):
        own = part('.'.join(path.relative_to(PACKAGE.parent).with_suffix('').parts))
        for module in imports(path):
            if RANK[part(module)] > RANK[own]:
                wrong.append(f'{path.relative_to(PACKAGE.parent)} imports {module}')
    assert not wrong, wrong


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
