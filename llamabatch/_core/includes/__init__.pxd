# Makes ``llamabatch._core.includes`` a cimport-able package of C declarations.
