"""One home for each small concept: the argument checks (``collab_vit/checks.py``), the one answer to "can this layer
convert, and if not why" (``layers/construction.conversion_reason``) that the layer, the support check and the
conversion give alike, the small helpers the package writes once (``replace_submodule``, timm's ``attn_dim``,
``weights_io.one_line``, the model-name scheme and a layer's key dim in ``models.py``), and the conversion's concepts
(one weight-only conversion, one key-dim resolver, one output error, one tensor error, one per-image KL)."""
import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from timm.layers import Attention

import collab_vit
from collab_vit import checks
from collab_vit.conversion.calibration import blockwise
from collab_vit.conversion.weights import decompose
from collab_vit.conversion.files import spectrum
from collab_vit.conversion.weights.support import check_model
from collab_vit.layers.attention import CollaborativeAttention
from collab_vit.training.config import ConfigError
from collab_vit.weights_io import WriteError

PACKAGE = Path(__file__).parents[1] / 'collab_vit'


@pytest.mark.parametrize('check, good, bad, what', [
    (checks.positive_int, [1, 7, np.int64(3)], [0, -2, 1.0, True, '3', None], 'a positive integer'),
    (checks.nonnegative_int, [0, 5, np.int32(2)], [-1, 0.0, False, '0'], 'a non-negative integer'),
    (checks.fraction, [1, 0.5, 1e-9, np.float32(0.25)], [0, 0.0, 1.5, float('nan'), True, '0.5'], 'in (0, 1]'),
    (checks.positive_real, [2, 0.1, 1e30], [0, -1.0, float('inf'), float('nan'), True, '1'],
     'a positive finite number'),
])
def test_one_style_one_integer_type(check, good, bad, what):
    """Integers are numbers.Integral (numpy's too) and never bool; reals are finite; one message style."""
    for value in good:
        assert check(value, 'x') == value and type(check(value, 'x')) in (int, float)
    for value in bad:
        with pytest.raises(ValueError) as error:
            check(value, 'x')
        assert str(error.value) == f'x must be {what}, got {value!r}'


def written_outside(pattern: str, home: str) -> list:
    """Lines of the package, outside the module ``home``, that match ``pattern``."""
    found = re.compile(pattern)
    return [f'{p.relative_to(PACKAGE)}:{i}' for p in PACKAGE.rglob('*.py') if p.relative_to(PACKAGE).as_posix() != home
            for i, line in enumerate(p.read_text().splitlines(), 1) if found.search(line)]


@pytest.mark.parametrize('pattern, home', [
    (r'numbers\.(Integral|Real)|isinstance\(\w+, bool\) or not isinstance', 'checks.py'),  # argument checks
    (r'rpartition\("\."\)', 'layers/construction.py'),  # parent_module
    (r'num_heads \* \w+\.head_dim', 'layers/construction.py'),  # timm's attn_dim: full_rank
    (r'str\(\w+\)(\.strip\(\))?\.splitlines\(\)\[0\]', 'weights_io.py'),  # an error's line: one_line
    (r'''f["'][^"']*(deit_\{|_k\{)|_k\(\\d|split\("_"\)\[2\]''', 'models.py'),  # the model-name scheme
    (r'''getattr\([^)]*["']key_dim["'], (getattr|0)''', 'models.py'),  # a layer's key dim: layer_key_dim
])
def test_written_once(pattern, home):
    """Each of these is written in its home module only."""
    assert not written_outside(pattern, home)


# a copy of "a positive integer or a list of them": a positive-integer check applied to each element of a list
POSITIVE_INTS_COPY = r'(positive_int|is_integer)\([^()]*\)( and \w+ > 0)? for \w+ in'


def test_one_check_for_a_positive_int_or_a_list_of_them():
    """``checks.positive_ints`` is the one check of a key dim (one for every layer, or one per layer): a copy is
    found by what it computes (the check applied to each element of a list; the three copies it replaced, in
    ``dims.check_spec``, ``models.py`` and the training config, are the examples), and the sites that read a key dim
    each name the bad value."""
    for old in ('return [positive_int(k, "key_dim") for k in spec]',
                'dims = tuple(positive_int(k, "key_dim") for k in key_dim)',
                'if not values or not all(is_integer(v) and v > 0 for v in values):'):
        assert re.search(POSITIVE_INTS_COPY, old), old
    assert not written_outside(POSITIVE_INTS_COPY, 'checks.py')
    assert any(where.startswith('checks.py:') for where in written_outside(POSITIVE_INTS_COPY, ''))
    import timm
    from collab_vit.conversion.weights.dims import check_spec
    from collab_vit.training.config import check_key_dim_value
    assert checks.positive_ints(np.int64(4), 'k') == 4 and checks.positive_ints((4, 8), 'k') == [4, 8]
    for bad in (0, -3, 1.5, '8', True, [], [8, 0], [8, '8']):
        named = [repr(bad)] + ([repr(v) for v in bad] if isinstance(bad, list) else [])
        for site in (lambda: checks.positive_ints(bad, 'key_dim'), lambda: check_spec(bad),
                     lambda: timm.create_model('collab_deit_tiny_patch16_224', key_dim=bad, img_size=32,
                                               patch_size=8, depth=2),
                     lambda: check_key_dim_value(bad, 'test.yaml')):
            with pytest.raises(ValueError) as error:
                site()
            message = str(error.value)
            assert '\n' not in message and any(f'{n} for' in message or message.endswith(f'got {n}')
                                                for n in named), message


@pytest.mark.parametrize('pattern, home', [
    (r'\.norm\(\) / \w+\.norm\(\)', 'conversion/weights/fit.py'),  # a layer's relative output error: fit.output_error
    # a layer's tensor error: fit.tensor_error
    (r'\.query\.weight\.T, \w+\.key\.weight\.T', 'conversion/weights/fit.py'),
    (r'kl_div\(', 'conversion/calibration/objective.py'),  # the per-image KL to the source's outputs: objective.scores
    (r'\w*dims?\w* % 2\b', 'conversion/weights/dims.py'),  # even key dims of rotary layers: dims.layer_dims
    (r'\[(?!None)\w+\] \* len\(\w*layers\)', 'conversion/weights/dims.py'),  # one key dim for every layer
    # key-dim specs
    (r'entries but the model has \{len\(\w*layers', 'conversion/weights/dims.py'),
    # the held-out split: a seeded order of every calibration image, guard.held_out_split
    (r'randperm\(\w+, generator=torch\.Generator\(\)\.manual_seed', 'conversion/calibration/guard.py'),
    # a weight-only fit (a layer's fit without whitening sides): convert.convert_layer
    (r'fit_(?:attention|rotary)\(\w+, [\w.]+(?:\)|, \*\*)', 'conversion/weights/convert.py'),
])
def test_conversion_concepts_computed_once(pattern, home):
    """Each of these is computed in its home module of ``conversion/`` only (found by what the code
    computes, not by a function's name): the conversion paths call the one function."""
    assert not [where for where in written_outside(pattern, home) if where.startswith('conversion/')]
    assert any(where.startswith(home + ':') for where in written_outside(pattern, '')), 'the pattern finds nothing'


def test_token_sizes_read_by_one_hooked_pass():
    """One image's token size of each layer is read in one place, a forward pre-hook of ``blockwise.probe``
    (``token_bytes`` and ``layer_inputs`` take the shapes from it), found by what a hook computes from its input."""
    found = written_outside(r'\b(args|a)\[0\](\[0\])?\.(shape\[1:\]|numel\(\))', '')
    assert found == [next(w for w in found if w.startswith('conversion/calibration/blockwise.py:'))], found


def test_conversion_paths_call_the_one_function(monkeypatch):
    """The weight-only conversion of standard and rotary layers, the recipe's weight-only start and the conversion
    on load go through ``convert.convert_layer`` (its two fits counted where it calls them); every report's output
    error through ``fit.output_error``."""
    from collab_vit.conversion.weights import convert, fit
    from collab_vit.conversion import reparam
    calls = {'weight_only': 0, 'output_error': 0}
    output_error = fit.output_error

    def counted(name, function):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)
        return wrapper

    for name in ('fit_attention', 'fit_rotary'):
        monkeypatch.setattr(convert, name, counted('weight_only', getattr(convert, name)))
    monkeypatch.setattr(reparam, 'output_error', counted('output_error', output_error))
    import timm
    torch.manual_seed(0)
    for name, key_dim in (('deit_tiny_patch16_224', 8), ('vit_small_patch16_rope_224', 8)):
        model = timm.create_model(name, img_size=32, patch_size=8, depth=2, embed_dim=32, num_heads=2,
                                  num_classes=3).eval()
        collab_vit.reparametrize(model, key_dim, progress=False)
        collab_vit.reparametrize(timm.create_model(name, img_size=32, patch_size=8, depth=2, embed_dim=32,
                                                   num_heads=2, num_classes=3).eval(), key_dim,
                                 calibration=torch.randn(8, 3, 32, 32), effort='fast', progress=False)
    assert calls == {'weight_only': 8, 'output_error': 8}  # 2 models x 2 layers x (weight-only, calibrated)


def test_the_sites_use_them():
    """A few sites, each with the shared message (numpy integers are integers everywhere)."""
    with pytest.raises(ValueError, match=r'^key_dim must be a positive integer, got 0$'):
        CollaborativeAttention(24, 3, key_dim=0)
    assert CollaborativeAttention(24, 3, key_dim=np.int64(12)).key_dim == 12
    with pytest.raises(ValueError, match=r"^threshold must be in \(0, 1\], got 1.5$"):
        spectrum.suggest_key_dim([], 1.5)
    with pytest.raises(ValueError, match=r'^max_iter must be a non-negative integer, got -1$'):
        decompose.tucker_decompose(torch.ones(2, 4, 2), torch.ones(2, 4, 2), 2, max_iter=-1)
    with pytest.raises(ValueError, match=r'^refine_lr must be a positive finite number, got True$'):
        blockwise.refine_blocks([], [], iter([]), 1, True)


def _attention(**kwargs) -> Attention:
    return Attention(32, 4, qkv_bias=True, norm_layer=torch.nn.LayerNorm, **kwargs)


@pytest.mark.parametrize('kwargs, why', [
    (dict(qk_norm=True), "qk_norm normalises each head's queries and keys token by token"),
    (dict(gated=True), 'a gated output (sigmoid gate on the heads)'),
    (dict(attn_head_dim=4), 'heads x head dim (16) or output dim (32) differs from dim (32): not covered'),
    (dict(dim_out=16), 'heads x head dim (32) or output dim (16) differs from dim (32): not covered'),
])
def test_one_answer_to_can_this_convert(kwargs, why):
    """The layer, the one-layer conversion and the model's support check refuse a layer with one reason, spelled
    once."""
    attn = _attention(**kwargs)
    with pytest.raises(ValueError) as from_layer:
        CollaborativeAttention.from_attention(attn)
    with pytest.raises(ValueError) as converted:
        collab_vit.reparametrize_attention(attn, 8)
    with pytest.raises(ValueError) as supported:
        check_model(torch.nn.Sequential(attn))
    assert str(from_layer.value) == str(converted.value)
    assert str(from_layer.value).startswith(f'cannot convert this Attention: {why}'), from_layer.value
    assert f'cannot convert 0 (Attention): {why}' in str(supported.value), supported.value


def test_model_names_are_built_and_parsed_in_one_place():
    """Every DeiT-family name parses into its parts and is rebuilt from them; other names are outside the scheme."""
    from collab_vit.models import COLLAB_MODELS, CONCAT_MODELS, DEIT_MODELS, ModelName
    for name in DEIT_MODELS + COLLAB_MODELS + CONCAT_MODELS:
        parts = ModelName.parse(name)
        assert str(parts) == name and parts.family == ('' if name.startswith('deit') else name.split('_')[0])
    assert ModelName.parse('collab_deit_base_patch16_224_k192') == ModelName('base', 'collab', 192)
    assert ModelName.parse('vit_base_patch16_224') is None and ModelName.parse('deit_huge_patch16_224') is None


def test_one_helper_for_a_layers_key_dim():
    from collab_vit.models import layer_key_dim
    assert layer_key_dim(CollaborativeAttention(24, 3, key_dim=12)) == 12
    assert layer_key_dim(Attention(24, 3)) == 24 and layer_key_dim(torch.nn.Linear(2, 2)) == 0


def _entry(command: str, monkeypatch, body) -> int:
    """The exit code of ``main`` of ``command`` (collab-vit, train.py or eval.py) with its work replaced by ``body``
    (collab-vit leaves with SystemExit on failure, as argparse does)."""
    from collab_vit import cli
    from collab_vit.training import eval_cli, trainer
    if command == 'collab-vit':
        monkeypatch.setattr(cli, '_models', lambda args: body())
        try:
            return cli.main(['models'])
        except SystemExit as exit_info:
            return exit_info.code
    module = trainer if command == 'train.py' else eval_cli
    monkeypatch.setattr(module, 'train' if command == 'train.py' else 'run', lambda cfg: body())
    monkeypatch.setattr(module, 'parse_train_args' if command == 'train.py' else 'parse_args', lambda argv: None)
    return module.main([])


def _raise(error: BaseException):
    def body():
        raise error
    return body


def _signal(signum: int):
    def body():
        os.kill(os.getpid(), signum)
        time.sleep(5)  # the handler raises first
    return body


@pytest.mark.parametrize('command', ['collab-vit', 'train.py', 'eval.py'])
@pytest.mark.parametrize('cause, body, code', [
    ('bad input', _raise(ConfigError('bad flag')), 2),
    ('failed write', _raise(WriteError('no space left on device', '/tmp/x')), 1),
    ('SIGINT', _signal(signal.SIGINT), 130),
    ('SIGTERM', _signal(signal.SIGTERM), 143),
])
def test_one_main_wrapper(command, cause, body, code, monkeypatch, capsys):
    """The three entry points: the same exit code for the same cause, one line on stderr, no traceback, and the
    SIGTERM handler put back."""
    handler = signal.getsignal(signal.SIGTERM)
    got = _entry(command, monkeypatch, body)
    err = capsys.readouterr().err
    assert got == code and len(err.splitlines()) == 1 and 'Traceback' not in err, err
    assert signal.getsignal(signal.SIGTERM) == handler
    what = {2: 'error: bad flag', 1: 'error: no space left on device writing /tmp/x', 130: 'interrupted (SIGINT)',
            143: 'terminated (SIGTERM)'}
    assert what[code] in err, err
