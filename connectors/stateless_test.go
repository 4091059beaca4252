package connectors

import (
	"context"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The Kthena router kept per-request state on connector structs shared by
// all requests of a pool, and concurrent requests swapped prompts. pdx's
// connectors are stateless strategies: these tests keep them so.

// TestConnectorsHoldOnlyImmutableConfig checks every registered connector's
// dynamic type: a value (not a pointer) whose fields, recursively, are all
// of kinds that cannot share memory between requests, with no
// pointer-receiver methods.
func TestConnectorsHoldOnlyImmutableConfig(t *testing.T) {
	for name, c := range registered(t) {
		typ := reflect.TypeOf(c)
		require.NotEqual(t, reflect.Pointer, typ.Kind(), "%s: connector is a pointer (%s)", name, typ)
		require.NoError(t, immutableType(typ, typ.String()), name)
		ptr := reflect.PointerTo(typ)
		for i := range ptr.NumMethod() {
			m := ptr.Method(i)
			_, ok := typ.MethodByName(m.Name)
			require.True(t, ok, "%s: method %s has a pointer receiver", name, m.Name)
		}
	}
}

// immutableType returns an error naming the first part of t that could hold
// or reach mutable shared state: anything but booleans, numbers, strings and
// structs and arrays of those. sync and sync/atomic types are structs of
// integers, so they are refused by package.
func immutableType(t reflect.Type, path string) error {
	switch t.Kind() {
	case reflect.Bool, reflect.String,
		reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64,
		reflect.Float32, reflect.Float64:
		return nil
	case reflect.Array:
		return immutableType(t.Elem(), path+"[]")
	case reflect.Struct:
		if pkg := t.PkgPath(); pkg == "sync" || pkg == "sync/atomic" || strings.HasPrefix(pkg, "internal/") {
			return fmt.Errorf("%s is %s, a synchronization type: connectors hold no state", path, t)
		}
		for i := range t.NumField() {
			f := t.Field(i)
			if err := immutableType(f.Type, path+"."+f.Name); err != nil {
				return err
			}
		}
		return nil
	}
	return fmt.Errorf("%s is a %s (%s): per-request state could live there; keep it in arguments and results", path, t.Kind(), t)
}

// TestImmutableTypeGuard shows the guard above catches what it must.
func TestImmutableTypeGuard(t *testing.T) {
	type inner struct {
		Port int
		Name string
	}
	good := []any{
		struct{}{},
		struct {
			A bool
			B int64
			C uint8
			D float64
			E string
			F [2]inner
			G time.Duration
		}{},
	}
	for _, v := range good {
		require.NoError(t, immutableType(reflect.TypeOf(v), "c"), "%T", v)
	}
	bad := map[string]any{
		"pointer":   struct{ P *int }{},
		"map":       struct{ M map[string]string }{},
		"slice":     struct{ S []byte }{},
		"chan":      struct{ C chan error }{},
		"func":      struct{ F func() }{},
		"interface": struct{ I any }{},
		"context":   struct{ Ctx context.Context }{},
		"mutex":     struct{ Mu sync.Mutex }{},
		"atomic":    struct{ N atomic.Int64 }{},
		"nested":    struct{ In struct{ Body []byte } }{},
		"array":     struct{ A [1]*int }{},
		"uintptr":   struct{ U uintptr }{},
	}
	for name, v := range bad {
		require.Error(t, immutableType(reflect.TypeOf(v), "c"), name)
	}
}

// packageVars allowlists the package-level variables of the non-test files,
// each with why it is never written after package initialization. Any other
// package-level var fails TestNoMutablePackageState: per-request state there
// would be shared by all requests.
var packageVars = map[string]string{
	// Fixed JSON fragments, only passed as jsonedit.Edit values, which
	// AppendEdited copies into a fresh buffer: read, never written,
	// appended to or aliased by an output.
	"nixlPrefillParams":    "fixed JSON fragment",
	"trtllmGenerationOnly": "fixed JSON fragment",
	// The values of the prefill-only edits ("stream":false and the one-token
	// limit), package-level so that building those edits allocates nothing;
	// like the fragments above, only ever passed as jsonedit.Edit values.
	"jsonFalse": "fixed JSON fragment",
	"jsonOne":   "fixed JSON fragment",
	// Built from the specs at package initialization; stripped only copies
	// its edits out.
	"clientKeyDeletes": "the specs' client keys",
}

// TestNoMutablePackageState parses the package's non-test files and fails on
// package-level vars outside packageVars, and on any statement that could
// write to an allowlisted one: an assignment or ++/-- rooted at it, taking
// its address, or append/copy/clear/delete on it.
func TestNoMutablePackageState(t *testing.T) {
	files, err := filepath.Glob("*.go")
	require.NoError(t, err)
	fset := token.NewFileSet()
	declared := map[string]bool{}
	for _, file := range files {
		if strings.HasSuffix(file, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, file, nil, parser.SkipObjectResolution)
		require.NoError(t, err)
		for _, decl := range f.Decls {
			gen, ok := decl.(*ast.GenDecl)
			if !ok || gen.Tok != token.VAR {
				continue
			}
			for _, spec := range gen.Specs {
				for _, name := range spec.(*ast.ValueSpec).Names {
					if name.Name == "_" {
						continue // a compile-time interface assertion: nothing to write to
					}
					if _, ok := packageVars[name.Name]; !ok {
						t.Errorf("%s: package-level var %s: connectors keep no package state (use a const, or a local)", fset.Position(name.Pos()), name.Name)
					}
					declared[name.Name] = true
				}
			}
		}
		ast.Inspect(f, func(n ast.Node) bool {
			var targets []ast.Expr
			switch n := n.(type) {
			case *ast.AssignStmt:
				targets = n.Lhs
			case *ast.IncDecStmt:
				targets = []ast.Expr{n.X}
			case *ast.UnaryExpr:
				if n.Op == token.AND {
					targets = []ast.Expr{n.X}
				}
			case *ast.CallExpr:
				if fn, ok := n.Fun.(*ast.Ident); ok && len(n.Args) > 0 {
					switch fn.Name {
					case "append", "copy", "clear", "delete":
						targets = n.Args[:1]
					}
				}
			}
			for _, target := range targets {
				if name := rootIdent(target); packageVars[name] != "" {
					t.Errorf("%s: %s is written to or aliased; package-level vars are read-only", fset.Position(target.Pos()), name)
				}
			}
			return true
		})
	}
	for name := range packageVars {
		require.True(t, declared[name], "packageVars lists %s, which is no longer declared", name)
	}
}

// rootIdent returns the variable an expression like v, v[i], v.f, v[:n],
// *v or (v) is rooted at, or "".
func rootIdent(e ast.Expr) string {
	for {
		switch x := e.(type) {
		case *ast.Ident:
			return x.Name
		case *ast.IndexExpr:
			e = x.X
		case *ast.SliceExpr:
			e = x.X
		case *ast.SelectorExpr:
			e = x.X
		case *ast.StarExpr:
			e = x.X
		case *ast.ParenExpr:
			e = x.X
		default:
			return ""
		}
	}
}
