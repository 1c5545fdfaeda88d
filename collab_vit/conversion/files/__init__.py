"""The files stage of a conversion: the command line's side and what converted files record. Importing this
package imports none of its modules.

The modules, top to bottom (each imports only modules listed below it):

* ``commands``: ``collab-vit convert`` / ``analyze``: a source loaded, converted, written to a file or hub folder.
* ``spectrum``: how much the heads share (section 3.1): the redundancy spectrum, its table and plot.
* ``pretrained``: converted files and timm's DeiT weights converted on load (tags, cache).
* ``record``: what a converted model's file or folder records, and how the model is rebuilt from it.
* ``families``: the one table of timm's families that convert, their variants and refusals.
"""
