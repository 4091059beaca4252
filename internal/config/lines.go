package config

import (
	"fmt"
	"regexp"
	"strings"

	yaml3 "go.yaml.in/yaml/v3"
)

// lines maps the field paths of a file, as its errors name them
// ("pools[0].decode[1].address", `kubernetes.match_labels["app"]`), to
// the YAML lines they are written on.
type lines map[string]int

// lineIndex reads the lines of data's field paths. A file the YAML parser
// refuses has none (its errors carry their own).
func lineIndex(data []byte) lines {
	var doc yaml3.Node
	if err := yaml3.Unmarshal(data, &doc); err != nil {
		return nil
	}
	l := lines{}
	if len(doc.Content) > 0 {
		l.walk(doc.Content[0], "", 0)
	}
	return l
}

// maxAliasDepth bounds how deep walk follows aliases: a file may alias a
// node inside itself.
const maxAliasDepth = 8

func (l lines) walk(n *yaml3.Node, path string, aliases int) {
	if n.Kind == yaml3.AliasNode {
		if aliases < maxAliasDepth && n.Alias != nil {
			l.walk(n.Alias, path, aliases+1)
		}
		return
	}
	switch n.Kind {
	case yaml3.MappingNode:
		for i := 0; i+1 < len(n.Content); i += 2 {
			key, value := n.Content[i], n.Content[i+1]
			// A key is a field or a map key: which, the schema knows;
			// both spellings are kept, and what is under a key under
			// the spelling a field would have, when it could be one.
			field, mapKey := joinPath(path, key.Value), fmt.Sprintf("%s[%q]", path, key.Value)
			l[field], l[mapKey] = key.Line, key.Line
			if fieldName.MatchString(key.Value) {
				l.walk(value, field, aliases)
			} else {
				l.walk(value, mapKey, aliases)
			}
		}
	case yaml3.SequenceNode:
		for i, item := range n.Content {
			p := fmt.Sprintf("%s[%d]", path, i)
			l[p] = item.Line
			l.walk(item, p, aliases)
		}
	}
}

var fieldName = regexp.MustCompile(`^[a-z_][a-z0-9_]*$`)

func joinPath(path, field string) string {
	if path == "" {
		return field
	}
	return path + "." + field
}

// of returns the line of path, or of the nearest enclosing field written in
// the file (a default or a missing field is its parent's problem); 0 when
// none is.
func (l lines) of(path string) int {
	for path != "" {
		if n, ok := l[path]; ok {
			return n
		}
		path = parent(path)
	}
	return 0
}

// parent is path without its last element: "a.b[2]" -> "a.b" -> "a".
func parent(path string) string {
	if strings.HasSuffix(path, "]") {
		if i := strings.LastIndex(path, "["); i >= 0 {
			return path[:i]
		}
	}
	if i := strings.LastIndex(path, "."); i >= 0 {
		return path[:i]
	}
	return ""
}

// leadingPath matches the field path a message starts with, as the
// connectors' and pickers' validation writes it: "pools[0].x: problem".
var leadingPath = regexp.MustCompile(`^([a-z_][a-z0-9_]*(?:\[(?:[0-9]+|"[^"]*")\]|\.[a-z_][a-z0-9_]*)*): `)

// pathOf returns the field path err is about: "" when it names none.
func pathOf(err error) string {
	if fe, ok := err.(*fieldError); ok {
		return fe.path
	}
	if m := leadingPath.FindStringSubmatch(err.Error()); m != nil {
		return m[1]
	}
	return ""
}

// lineOf returns the YAML line of err: its own, or its field path's.
func (l lines) lineOf(err error) int {
	if fe, ok := err.(*fieldError); ok && fe.line > 0 {
		return fe.line
	}
	return l.of(pathOf(err))
}

// scope is the part of the file a problem at path makes unreliable: its
// top-level field, or the list element of one ("pools[1]"); "" for the
// whole file.
func scope(path string) string {
	end := len(path)
	if i := strings.IndexAny(path, ".["); i >= 0 {
		end = i
		if path[i] == '[' {
			if j := strings.IndexByte(path[i:], ']'); j >= 0 {
				end = i + j + 1
			}
		}
	}
	return path[:end]
}

// follows reports whether validation's finding err may follow from leaving
// out the value at path: it lies in the same part of the file, or names it
// ("required when kv_events.port is unset").
func follows(err error, path string) bool {
	return within(pathOf(err), scope(path)) || path != "" && strings.Contains(err.Error(), path)
}

// within reports whether path lies in scope s.
func within(path, s string) bool {
	return s == "" || path == s || strings.HasPrefix(path, s+".") || strings.HasPrefix(path, s+"[")
}
