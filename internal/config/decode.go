package config

import (
	"bytes"
	"encoding/json"
	"fmt"
	"maps"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/reflect/protoreflect"
	"sigs.k8s.io/yaml"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
)

// fieldError is a problem with the value at a field path such as
// "pools[0].decode[1].address".
type fieldError struct {
	path string
	msg  string
}

func (e *fieldError) Error() string {
	if e.path == "" {
		return e.msg
	}
	return e.path + ": " + e.msg
}

// decode turns YAML or JSON into a Config without applying defaults.
//
// protojson is strict, but its errors carry no field path, so the generic JSON
// is first checked against the message descriptors: that catches unknown
// fields and wrong types with their paths, leaving protojson only the
// conversion itself.
//
// choices are the values that name none of their enum field's choices: such
// a field is left unset, and its error is reported with validation's, since
// the file's shape is sound.
func decode(data []byte) (cfg *configv1.Config, errs, choices []error) {
	cfg, errs, c := decodeTree(data)
	if c != nil {
		choices = c.choices
	}
	return cfg, errs, choices
}

func decodeTree(data []byte) (*configv1.Config, []error, *checker) {
	// The strict variant rejects duplicate keys instead of keeping the last.
	js, err := yaml.YAMLToJSONStrict(data)
	if err != nil {
		return nil, []error{err}, nil
	}
	dec := json.NewDecoder(bytes.NewReader(js))
	dec.UseNumber() // keep integers exact for range checks
	var tree any
	if err := dec.Decode(&tree); err != nil {
		return nil, []error{err}, nil
	}

	cfg := &configv1.Config{}
	if tree == nil { // empty document
		return cfg, nil, nil
	}
	c := &checker{}
	tree = c.message(tree, cfg.ProtoReflect().Descriptor(), "")
	if len(c.errs) > 0 {
		return nil, c.errs, c
	}
	if js, err = json.Marshal(tree); err != nil {
		return nil, []error{err}, c
	}
	if err := protojson.Unmarshal(js, cfg); err != nil {
		return nil, []error{err}, c
	}
	return cfg, nil, c
}

// checker walks generic JSON against a message descriptor, collecting errors.
type checker struct {
	errs    []error
	choices []error // see decode
}

func (c *checker) fail(path, format string, args ...any) {
	c.errs = append(c.errs, &fieldError{path: path, msg: fmt.Sprintf(format, args...)})
}

// message checks v against md and returns it, with durations rewritten into
// the form protojson accepts.
func (c *checker) message(v any, md protoreflect.MessageDescriptor, path string) any {
	obj, ok := v.(map[string]any)
	if !ok {
		c.fail(path, "expected a mapping (%s), got %s", md.Name(), describe(v))
		return v
	}
	for _, key := range slices.Sorted(maps.Keys(obj)) {
		p := key
		if path != "" {
			p = path + "." + key
		}
		// ByName matches only the proto (snake_case) names, not the
		// lowerCamel JSON names protojson would also accept, so the
		// documentation has a single spelling.
		fd := md.Fields().ByName(protoreflect.Name(key))
		if fd == nil {
			c.errs = append(c.errs, fmt.Errorf("unknown field %q (known fields of %s: %s)",
				p, md.Name(), fieldNames(md)))
			continue
		}
		if obj[key] == nil {
			continue // null leaves the field unset, as in protojson
		}
		obj[key] = c.field(obj[key], fd, p)
	}
	return obj
}

func (c *checker) field(v any, fd protoreflect.FieldDescriptor, path string) any {
	if fd.IsMap() {
		return c.mapField(v, fd, path)
	}
	if !fd.IsList() {
		return c.value(v, fd, path)
	}
	list, ok := v.([]any)
	if !ok {
		c.fail(path, "expected a list, got %s", describe(v))
		return v
	}
	for i, elem := range list {
		list[i] = c.value(elem, fd, fmt.Sprintf("%s[%d]", path, i))
	}
	return list
}

// mapField checks a map field: a mapping whose values are checked as fd's
// map values, each named path["key"] (label keys hold dots and slashes).
func (c *checker) mapField(v any, fd protoreflect.FieldDescriptor, path string) any {
	obj, ok := v.(map[string]any)
	if !ok {
		c.fail(path, "expected a mapping, got %s", describe(v))
		return v
	}
	for _, key := range slices.Sorted(maps.Keys(obj)) {
		p := fmt.Sprintf("%s[%q]", path, key)
		if obj[key] == nil {
			c.fail(p, "expected a value, got null")
			continue
		}
		obj[key] = c.value(obj[key], fd.MapValue(), p)
	}
	return obj
}

// value checks a single (non-list) value of field fd.
func (c *checker) value(v any, fd protoreflect.FieldDescriptor, path string) any {
	switch fd.Kind() {
	case protoreflect.MessageKind:
		md := fd.Message()
		if md.FullName() == "google.protobuf.Duration" {
			return c.duration(v, path)
		}
		if md.ParentFile().Package() == "google.protobuf" {
			return v // other well-known types have special JSON forms
		}
		return c.message(v, md, path)
	case protoreflect.StringKind:
		if _, ok := v.(string); !ok {
			c.fail(path, "expected a string, got %s", describe(v))
		}
	case protoreflect.EnumKind:
		return c.enum(v, fd.Enum(), path)
	case protoreflect.BoolKind:
		if _, ok := v.(bool); !ok {
			c.fail(path, "expected true or false, got %s", describe(v))
		}
	case protoreflect.Uint32Kind:
		n, ok := v.(json.Number)
		if ok {
			_, err := strconv.ParseUint(n.String(), 10, 32)
			ok = err == nil
		}
		if !ok {
			c.fail(path, "expected a whole number from 0 to %d, got %s", math.MaxUint32, describe(v))
		}
	default:
		// Kinds the schema does not use are left to protojson, which is
		// strict too but names the field without its path.
	}
	return v
}

// enum takes a choice of an enum field as the file writes it, its value's
// name without the enum's prefix in lower case ("reject" for
// SATURATION_ACTION_REJECT), or the full name protojson writes, and
// rewrites it into the latter. The zero value, *_UNSPECIFIED, is no choice:
// it is what an unset field reads as.
func (c *checker) enum(v any, ed protoreflect.EnumDescriptor, path string) any {
	choices := enumChoices(ed)
	if s, ok := v.(string); ok {
		for i, name := range choices {
			if s == name || s == string(ed.Values().Get(i+1).Name()) {
				return string(ed.Values().Get(i + 1).Name())
			}
		}
	}
	quoted := make([]string, len(choices))
	for i, name := range choices {
		quoted[i] = strconv.Quote(name)
	}
	list := strings.Join(quoted[:len(quoted)-1], ", ") + " or " + quoted[len(quoted)-1]
	if s, ok := v.(string); ok {
		c.choices = append(c.choices, &fieldError{path: path, msg: fmt.Sprintf("%q is not %s", s, list)})
	} else {
		c.choices = append(c.choices, &fieldError{path: path, msg: fmt.Sprintf("expected %s, got %s", list, describe(v))})
	}
	return nil // unset
}

// enumChoices returns the names the file gives ed's values but the first
// (its *_UNSPECIFIED zero value), in order.
func enumChoices(ed protoreflect.EnumDescriptor) []string {
	values := ed.Values()
	prefix := strings.TrimSuffix(string(values.Get(0).Name()), "UNSPECIFIED")
	names := make([]string, values.Len()-1)
	for i := range names {
		names[i] = strings.ToLower(strings.TrimPrefix(string(values.Get(i+1).Name()), prefix))
	}
	return names
}

// duration accepts Go duration syntax ("1m30s"), a superset of the seconds-only
// protobuf JSON form, and rewrites it into the latter for protojson.
func (c *checker) duration(v any, path string) any {
	s, ok := v.(string)
	if !ok {
		c.fail(path, `expected a duration such as "30s", got %s`, describe(v))
		return v
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		c.fail(path, "invalid duration %q", s)
		return v
	}
	sign, n := "", uint64(d)
	if d < 0 {
		sign, n = "-", -n // in uint64 so that math.MinInt64 negates correctly
	}
	return fmt.Sprintf("%s%d.%09ds", sign, n/1e9, n%1e9)
}

func fieldNames(md protoreflect.MessageDescriptor) string {
	fields := md.Fields()
	names := make([]string, fields.Len())
	for i := range names {
		names[i] = string(fields.Get(i).Name())
	}
	return strings.Join(names, ", ")
}

// describe renders a generic JSON value for error messages.
func describe(v any) string {
	switch v := v.(type) {
	case nil:
		return "null"
	case string:
		return fmt.Sprintf("string %q", v)
	case json.Number:
		return "number " + v.String()
	case bool:
		return strconv.FormatBool(v)
	case []any:
		return "a list"
	case map[string]any:
		return "a mapping"
	default:
		return fmt.Sprintf("%T", v)
	}
}
